/*
 * check_daemon.c — deepepd as a whole process: its socket, its clients, its
 * signals, its job table.  Every test starts the real daemon on a temporary
 * socket and speaks the protocol with proto_* on a raw socket, so these
 * tests do not depend on the client library.
 */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "deepep.h"
#include "fdpass.h"
#include "proto.h"
#include "testutil.h"

#define NOBODY 65534

/* ---- speaking the protocol on a raw socket ------------------------------- */

/* snprintf that fails the test rather than truncate a path or a message. */
static void sfmt(char *buf, size_t len, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void sfmt(char *buf, size_t len, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(buf, len, fmt, ap);
  va_end(ap);
  ck_assert_msg(n >= 0 && (size_t)n < len, "%zu bytes are too few for \"%s\"", len, fmt);
}

static int64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void sleep_ms(int ms) {
  struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

static int send_all(int fd, const void *buf, size_t len) {
  const uint8_t *p = buf;
  while (len > 0) {
    ssize_t n = send(fd, p, len, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0)
      return -1;
    p += n;
    len -= (size_t)n;
  }
  return 0;
}

static int send_frame(int fd, uint16_t type, uint32_t req, const void *msg) {
  struct proto_buf b;
  proto_buf_init(&b);
  int rc = proto_frame_encode(&b, type, 0, req, msg);
  if (rc == 0)
    rc = send_all(fd, b.data, b.len);
  proto_buf_free(&b);
  return rc;
}

/* Read exactly len bytes by the deadline: 0, -1 EOF/error, -2 timeout. */
/* Read len bytes; fds that ride on them are appended to fds[*nfds] (when fds != NULL). */
static int read_exact_fds(int fd, void *buf, size_t len, int64_t deadline, int *fds, int *nfds) {
  uint8_t *p = buf;
  while (len > 0) {
    int64_t left = deadline - now_ms();
    if (left <= 0)
      return -2;
    struct pollfd pfd = {.fd = fd, .events = POLLIN};
    int r = poll(&pfd, 1, (int)left);
    if (r < 0 && errno == EINTR)
      continue;
    if (r == 0)
      return -2;
    ssize_t n = fds != NULL ? fdpass_recv(fd, p, len, fds, DEP_PROTO_MAX_FDS, nfds)
                            : read(fd, p, len);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0)
      return -1;
    p += n;
    len -= (size_t)n;
  }
  return 0;
}

static int read_exact(int fd, void *buf, size_t len, int64_t deadline) {
  return read_exact_fds(fd, buf, len, deadline, NULL, NULL);
}

struct frame {
  struct dep_frame_hdr h;
  uint8_t body[DEP_PROTO_MAX_BODY];
};

/* One frame within timeout_ms: 0, -1 EOF, -2 timeout, -3 bad header. */
static int recv_frame(int fd, struct frame *f, int timeout_ms) {
  int64_t deadline = now_ms() + timeout_ms;
  uint8_t hdr[DEP_PROTO_HDR_LEN];
  int rc = read_exact(fd, hdr, sizeof hdr, deadline);
  if (rc != 0)
    return rc;
  if (proto_hdr_decode(hdr, DEP_PROTO_MAX_BODY, &f->h, NULL, 0) != 0)
    return -3;
  return read_exact(fd, f->body, f->h.body_len, deadline);
}

/* As recv_frame, collecting the fds that ride on the frame. */
static int recv_frame_fds(int fd, struct frame *f, int timeout_ms, int *fds, int *nfds) {
  int64_t deadline = now_ms() + timeout_ms;
  uint8_t hdr[DEP_PROTO_HDR_LEN];
  int rc = read_exact_fds(fd, hdr, sizeof hdr, deadline, fds, nfds);
  if (rc != 0)
    return rc;
  if (proto_hdr_decode(hdr, DEP_PROTO_MAX_BODY, &f->h, NULL, 0) != 0)
    return -3;
  return read_exact(fd, f->body, f->h.body_len, deadline);
}

static struct frame *frame_new(void) {
  struct frame *f = malloc(sizeof *f);
  ck_assert_ptr_nonnull(f);
  return f;
}

/* Expect an ERROR frame with this code; its message goes to msg. */
static void expect_error(int fd, int code, char *msg, size_t len) {
  struct frame *f = frame_new();
  int rc = recv_frame(fd, f, 5000);
  ck_assert_msg(rc == 0, "no reply (rc %d) where an error %s was expected", rc,
                dep_errname(code));
  ck_assert_msg(f->h.type == DEP_MSG_ERROR, "got %s where an error %s was expected",
                proto_type_name(f->h.type), dep_errname(code));
  struct dep_msg_error e;
  ck_assert_int_eq(proto_decode_error(f->body, f->h.body_len, &e), 0);
  ck_assert_msg(e.code == code, "error %s (%s) where %s was expected", dep_errname(e.code),
                e.message, dep_errname(code));
  if (msg != NULL)
    sfmt(msg, len, "%s", e.message);
  free(f);
}

/* The peer sends nothing more and closes (a pending reply would be a failure). */
static void expect_eof(int fd) {
  struct frame *f = frame_new();
  int rc = recv_frame(fd, f, 5000);
  ck_assert_msg(rc == -1, "expected the daemon to close the connection, got rc %d (type %s)", rc,
                rc == 0 ? proto_type_name(f->h.type) : "-");
  free(f);
}

/* Nothing arrives within ms (the connection stays open). */
static void expect_silence(int fd, int ms) {
  struct pollfd pfd = {.fd = fd, .events = POLLIN};
  ck_assert_msg(poll(&pfd, 1, ms) == 0, "a reply arrived where none was due yet");
}

static void hello_as(int fd, uint32_t version) {
  struct dep_msg_hello h = {.version = version, .pid = (uint32_t)getpid()};
  sfmt(h.name, sizeof h.name, "check_daemon");
  ck_assert_int_eq(send_frame(fd, DEP_MSG_HELLO, 1, &h), 0);
}

static void expect_hello_ok(int fd) {
  struct frame *f = frame_new();
  ck_assert_int_eq(recv_frame(fd, f, 5000), 0);
  ck_assert_str_eq(proto_type_name(f->h.type), "HELLO_OK");
  struct dep_msg_hello_ok ok;
  ck_assert_int_eq(proto_decode_hello_ok(f->body, f->h.body_len, &ok), 0);
  ck_assert_uint_eq(ok.version, DEP_PROTO_VERSION);
  ck_assert_str_eq(ok.daemon_version, DEP_VERSION_STRING);
  free(f);
}

/* A connected, greeted client. */
static int client(const struct tu_daemon *d) {
  int fd = tu_connect_raw(d->sock);
  ck_assert_msg(fd >= 0, "cannot connect to %s", d->sock);
  hello_as(fd, DEP_PROTO_VERSION);
  expect_hello_ok(fd);
  return fd;
}

static struct dep_status *recv_status(int fd, uint32_t req) {
  struct frame *f = frame_new();
  ck_assert_int_eq(recv_frame(fd, f, 5000), 0);
  ck_assert_str_eq(proto_type_name(f->h.type), "STATUS_OK");
  ck_assert_uint_eq(f->h.request_id, req);
  struct dep_status *st = calloc(1, sizeof *st);
  ck_assert_int_eq(proto_decode_status(f->body, f->h.body_len, st), 0);
  free(f);
  return st;
}

static struct dep_status *status(int fd) {
  ck_assert_int_eq(send_frame(fd, DEP_MSG_STATUS, 7, NULL), 0);
  return recv_status(fd, 7);
}

/* The job's entry in a fresh STATUS, or NULL; *attached / *expected filled. */
static bool job_listed(int fd, const char *id, uint32_t *attached, uint32_t *expected) {
  struct dep_status *st = status(fd);
  bool found = false;
  for (uint32_t i = 0; i < st->num_jobs; i++) {
    if (strcmp(st->jobs[i].job_id, id) == 0) {
      found = true;
      if (attached != NULL)
        *attached = st->jobs[i].ranks_attached;
      if (expected != NULL)
        *expected = st->jobs[i].ranks_expected;
    }
  }
  dep_status_free(st);
  return found;
}

/* Wait (up to 3 s) for the job to disappear from STATUS: closes are asynchronous. */
static bool job_gone(int fd, const char *id) {
  for (int i = 0; i < 300; i++) {
    if (!job_listed(fd, id, NULL, NULL))
      return true;
    sleep_ms(10);
  }
  return false;
}

/* Wait (up to 3 s) until STATUS shows n ranks of the job attached. */
static bool wait_attached(int fd, const char *id, uint32_t n) {
  for (int i = 0; i < 300; i++) {
    uint32_t at = 0;
    if (job_listed(fd, id, &at, NULL) && at == n)
      return true;
    sleep_ms(10);
  }
  return false;
}

/* Wait (up to timeout_ms) for the daemon's log to contain needle. */
static bool log_has(const struct tu_daemon *d, const char *needle, int timeout_ms) {
  int64_t deadline = now_ms() + timeout_ms;
  do {
    char *log = tu_daemon_log(d);
    bool found = strstr(log, needle) != NULL;
    free(log);
    if (found)
      return true;
    sleep_ms(20);
  } while (now_ms() < deadline);
  return false;
}

static void start(struct tu_daemon *d, const char *extra_yaml) {
  ck_assert_msg(tu_daemon_start(d, extra_yaml) == 0, "deepepd did not start");
}

static void stop_ok(struct tu_daemon *d) {
  int st = tu_daemon_stop(d);
  ck_assert_msg(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0,
                "deepepd did not exit cleanly (wait status %d)", st);
  tu_daemon_cleanup(d);
}

/* Run deepepd with args, output to out_path; returns its wait status. */
static int run_deepepd(const char *const args[], const char *out_path) {
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) {
    int fd = open(out_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
    }
    char *argv[16];
    int n = 0;
    argv[n++] = (char *)"deepepd";
    for (; args[n - 1] != NULL && n < 15; n++)
      argv[n] = (char *)args[n - 1];
    argv[n] = NULL;
    unsetenv("NOTIFY_SOCKET");
    execv(tu_bin("deepepd"), argv);
    _exit(127);
  }
  int st;
  for (int i = 0; i < 1000; i++) {
    if (waitpid(pid, &st, WNOHANG) == pid)
      return st;
    sleep_ms(10);
  }
  kill(pid, SIGKILL);
  waitpid(pid, &st, 0);
  ck_abort_msg("deepepd %s did not exit within 10 s", args[0]);
  return -1;
}

/* A whole (small) file as a string; the caller frees it. */
static char *slurp(const char *path) {
  char *text = calloc(1, 65536);
  ck_assert_ptr_nonnull(text);
  FILE *f = fopen(path, "r");
  if (f != NULL) {
    size_t n = fread(text, 1, 65535, f);
    text[n] = '\0';
    fclose(f);
  }
  return text;
}

/* ---- clients -------------------------------------------------------------- */

START_TEST(test_64_clients_at_once) {
  enum { N = 64 };
  struct tu_daemon d;
  start(&d, NULL);
  int fds[N];
  /* Every client connects and sends HELLO and STATUS before anyone reads. */
  for (int i = 0; i < N; i++) {
    fds[i] = tu_connect_raw(d.sock);
    ck_assert_int_ge(fds[i], 0);
  }
  for (int i = 0; i < N; i++) {
    hello_as(fds[i], DEP_PROTO_VERSION);
    ck_assert_int_eq(send_frame(fds[i], DEP_MSG_STATUS, 100 + (uint32_t)i, NULL), 0);
  }
  for (int i = 0; i < N; i++) {
    expect_hello_ok(fds[i]);
    struct dep_status *st = recv_status(fds[i], 100 + (uint32_t)i);
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
  struct dep_status *st = status(fds[0]);
  ck_assert_uint_eq(st->num_clients, N);
  dep_status_free(st);
  for (int i = 0; i < N; i++)
    close(fds[i]);
  stop_ok(&d);
}
END_TEST

START_TEST(test_disconnect_mid_frame) {
  struct tu_daemon d;
  start(&d, NULL);
  int good = client(&d);

  /* Half a header, then gone. */
  int a = tu_connect_raw(d.sock);
  uint8_t hdr[DEP_PROTO_HDR_LEN];
  struct dep_frame_hdr h = {.magic = DEP_PROTO_MAGIC, .version = DEP_PROTO_VERSION,
                            .type = DEP_MSG_HELLO, .request_id = 1, .body_len = 1000};
  proto_hdr_encode(&h, hdr);
  ck_assert_int_eq(send_all(a, hdr, 12), 0);
  close(a);
  /* A header promising 1000 bytes, 10 of them, then gone. */
  int b = tu_connect_raw(d.sock);
  uint8_t ten[10] = {0};
  ck_assert_int_eq(send_all(b, hdr, sizeof hdr), 0);
  ck_assert_int_eq(send_all(b, ten, sizeof ten), 0);
  close(b);

  ck_assert(log_has(&d, "middle of a frame header (12 of 24 bytes)", 3000));
  ck_assert(log_has(&d, "middle of a HELLO frame body (10 of 1000 bytes)", 3000));
  /* The daemon serves the old client and a new one. */
  struct dep_status *st = status(good);
  ck_assert_uint_eq(st->pid, (uint32_t)d.pid);
  dep_status_free(st);
  int fresh = client(&d);
  st = status(fresh);
  ck_assert_uint_eq(st->num_clients, 2);
  dep_status_free(st);
  close(good);
  close(fresh);
  stop_ok(&d);
}
END_TEST

/* Send raw bytes on a fresh greeted connection; expect ERROR code, then EOF. */
static void offend(const struct tu_daemon *d, const void *bytes, size_t len, int code,
                   bool greet) {
  int fd = greet ? client(d) : tu_connect_raw(d->sock);
  ck_assert_int_ge(fd, 0);
  ck_assert_int_eq(send_all(fd, bytes, len), 0);
  expect_error(fd, code, NULL, 0);
  expect_eof(fd);
  close(fd);
}

START_TEST(test_bad_frames_drop_only_the_offender) {
  struct tu_daemon d;
  start(&d, NULL);
  int good = client(&d);
  uint8_t hdr[DEP_PROTO_HDR_LEN];
  struct dep_frame_hdr ok = {.magic = DEP_PROTO_MAGIC, .version = DEP_PROTO_VERSION,
                             .type = DEP_MSG_STATUS, .request_id = 9};
  struct dep_frame_hdr h;

  h = ok;
  h.magic = 0xdeadbeef;
  proto_hdr_encode(&h, hdr);
  offend(&d, hdr, sizeof hdr, DEP_ERR_PROTOCOL, true);
  struct dep_status *st = status(good);
  dep_status_free(st);

  h = ok;
  h.body_len = DEP_PROTO_MAX_BODY + 1;
  proto_hdr_encode(&h, hdr);
  offend(&d, hdr, sizeof hdr, DEP_ERR_PROTOCOL, true);
  st = status(good);
  dep_status_free(st);

  h = ok;
  h.type = 999;
  proto_hdr_encode(&h, hdr);
  offend(&d, hdr, sizeof hdr, DEP_ERR_PROTOCOL, true);

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

  ck_assert(log_has(&d, "dropped: bad frame magic", 3000));
  /* The good client kept its one connection through all of it. */
  st = status(good);
  ck_assert_uint_eq(st->pid, (uint32_t)d.pid);
  dep_status_free(st);
  close(good);
  stop_ok(&d);
}
END_TEST

START_TEST(test_client_sending_fds_is_dropped) {
  struct tu_daemon d;
  start(&d, NULL);
  int good = client(&d);
  int fd = client(&d);
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
  expect_eof(fd);
  ck_assert(log_has(&d, "clients never send any", 3000));
  struct dep_status *st = status(good);
  dep_status_free(st);
  close(fd);
  close(good);
  stop_ok(&d);
}
END_TEST

START_TEST(test_version_mismatch_names_both_versions) {
  struct tu_daemon d;
  start(&d, NULL);
  char msg[DEP_MSG_TEXT_MAX];
  /* HELLO from a newer client. */
  int fd = tu_connect_raw(d.sock);
  hello_as(fd, DEP_PROTO_VERSION + 1);
  expect_error(fd, DEP_ERR_VERSION, msg, sizeof msg);
  char want[64];
  sfmt(want, sizeof want, "speaks version %d", DEP_PROTO_VERSION + 1);
  ck_assert_msg(strstr(msg, want) != NULL, "\"%s\" does not contain \"%s\"", msg, want);
  sfmt(want, sizeof want, "speaks version %d", DEP_PROTO_VERSION);
  ck_assert_msg(strstr(msg, want) != NULL, "\"%s\" does not contain \"%s\"", msg, want);
  expect_eof(fd);
  close(fd);
  /* A frame header of another version. */
  fd = tu_connect_raw(d.sock);
  uint8_t hdr[DEP_PROTO_HDR_LEN];
  struct dep_frame_hdr h = {.magic = DEP_PROTO_MAGIC, .version = DEP_PROTO_VERSION,
                            .type = DEP_MSG_STATUS, .request_id = 5};
  proto_hdr_encode(&h, hdr);
  hdr[4] = DEP_PROTO_VERSION + 6;
  ck_assert_int_eq(send_all(fd, hdr, sizeof hdr), 0);
  expect_error(fd, DEP_ERR_VERSION, msg, sizeof msg);
  sfmt(want, sizeof want, "version %d", DEP_PROTO_VERSION + 6);
  ck_assert_msg(strstr(msg, want) != NULL, "\"%s\" does not contain \"%s\"", msg, want);
  sfmt(want, sizeof want, "speaks %d", DEP_PROTO_VERSION);
  ck_assert_msg(strstr(msg, want) != NULL, "\"%s\" does not contain \"%s\"", msg, want);
  expect_eof(fd);
  close(fd);
  stop_ok(&d);
}
END_TEST

START_TEST(test_client_that_does_not_read_is_dropped) {
  struct tu_daemon d;
  start(&d, "limits:\n  client_queue_bytes: 64KiB\n");
  int good = client(&d);
  int fd = client(&d);
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
  uint8_t req[DEP_PROTO_HDR_LEN];
  struct dep_frame_hdr h = {.magic = DEP_PROTO_MAGIC, .version = DEP_PROTO_VERSION,
                            .type = DEP_MSG_STATUS, .request_id = 1};
  proto_hdr_encode(&h, req);
  /* Ask and ask and never read: the replies pile up in the daemon. */
  bool cut_off = false;
  int64_t deadline = now_ms() + 10000;
  while (!cut_off && now_ms() < deadline) {
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
  ck_assert(log_has(&d, "does not read its replies", 3000));
  struct dep_status *st = status(good);
  ck_assert_uint_eq(st->num_clients, 1);
  dep_status_free(st);
  close(fd);
  close(good);
  stop_ok(&d);
}
END_TEST

START_TEST(test_max_clients) {
  struct tu_daemon d;
  start(&d, "limits:\n  max_clients: 2\n");
  int a = client(&d), b = client(&d);
  int c = tu_connect_raw(d.sock);
  ck_assert_int_ge(c, 0);
  char msg[DEP_MSG_TEXT_MAX];
  expect_error(c, DEP_ERR_LIMIT, msg, sizeof msg);
  ck_assert_msg(strstr(msg, "limits.max_clients") != NULL, "said: %s", msg);
  expect_eof(c);
  close(c);
  close(b);
  /* A freed place is taken again (the close is noticed asynchronously). */
  bool served = false;
  for (int i = 0; i < 100 && !served; i++) {
    int e = tu_connect_raw(d.sock);
    hello_as(e, DEP_PROTO_VERSION);
    struct frame *f = frame_new();
    served = recv_frame(e, f, 5000) == 0 && f->h.type == DEP_MSG_HELLO_OK;
    free(f);
    close(e);
    if (!served)
      sleep_ms(10);
  }
  ck_assert(served);
  close(a);
  stop_ok(&d);
}
END_TEST

/* CPU time (ticks) the process has used, from /proc/PID/stat. */
static long cpu_ticks(pid_t pid) {
  char path[64], buf[1024];
  sfmt(path, sizeof path, "/proc/%d/stat", (int)pid);
  FILE *f = fopen(path, "r");
  ck_assert_ptr_nonnull(f);
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = '\0';
  const char *p = strrchr(buf, ')'); /* the command name may hold spaces */
  ck_assert_ptr_nonnull(p);
  unsigned long utime = 0, stime = 0;
  ck_assert_int_eq(sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %lu %lu", &utime,
                          &stime), 2);
  return (long)(utime + stime);
}

START_TEST(test_out_of_fds_pauses_accepting) {
  enum { N = 30 };
  /* The daemon inherits a small fd limit; the test keeps its own. */
  struct rlimit old, low;
  ck_assert_int_eq(getrlimit(RLIMIT_NOFILE, &old), 0);
  low = old;
  low.rlim_cur = 24;
  ck_assert_int_eq(setrlimit(RLIMIT_NOFILE, &low), 0);
  struct tu_daemon d;
  /* A pool of 2 chunks: 2 of the 24 fds. */
  int rc = tu_daemon_start(&d, "pool:\n  host_size: 4MiB\n  chunk_size: 2MiB\n");
  ck_assert_int_eq(setrlimit(RLIMIT_NOFILE, &old), 0);
  ck_assert_int_eq(rc, 0);
  int fds[N];
  for (int i = 0; i < N; i++) {
    fds[i] = tu_connect_raw(d.sock);
    ck_assert_int_ge(fds[i], 0);
  }
  ck_assert(log_has(&d, "accept: pausing new connections", 3000));
  /* Paused, not spinning on the connections it cannot take. */
  long t0 = cpu_ticks(d.pid);
  sleep_ms(1000);
  long used = cpu_ticks(d.pid) - t0;
  ck_assert_msg(used < 30, "deepepd used %ld ticks of CPU in 1 s while out of fds", used);
  /* Once fds are free again, the waiting connections are served (the last
   * in the backlog after a pause or two). */
  for (int i = 0; i < N - 1; i++)
    close(fds[i]);
  hello_as(fds[N - 1], DEP_PROTO_VERSION);
  struct frame *f = frame_new();
  ck_assert_int_eq(recv_frame(fds[N - 1], f, 10000), 0);
  ck_assert_str_eq(proto_type_name(f->h.type), "HELLO_OK");
  free(f);
  close(fds[N - 1]);
  stop_ok(&d);
}
END_TEST

/* ---- the socket ------------------------------------------------------------ */

START_TEST(test_second_daemon_refuses_to_start) {
  struct tu_daemon d;
  start(&d, NULL);
  int fd = client(&d);
  char out[300];
  sfmt(out, sizeof out, "%s/second.log", d.dir);
  const char *args[] = {"-c", d.conf, NULL};
  int st = run_deepepd(args, out);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) != 0, "a second deepepd started (status %d)",
                st);
  char *text = slurp(out);
  char want[300];
  sfmt(want, sizeof want, "another deepepd is already listening on %s (pid %d)", d.sock,
           (int)d.pid);
  ck_assert_msg(strstr(text, want) != NULL, "second daemon said: %s", text);
  free(text);
  /* The first keeps its socket file and its clients, and takes new ones. */
  struct stat sb;
  ck_assert_int_eq(stat(d.sock, &sb), 0);
  struct dep_status *s = status(fd);
  ck_assert_uint_eq(s->pid, (uint32_t)d.pid);
  dep_status_free(s);
  int fresh = client(&d);
  close(fresh);
  close(fd);
  stop_ok(&d);
}
END_TEST

START_TEST(test_stale_socket_is_reclaimed) {
  struct tu_daemon d;
  memset(&d, 0, sizeof d);
  tu_tmpdir(d.dir, sizeof d.dir);
  char path[300];
  sfmt(path, sizeof path, "%s/d.sock", d.dir);
  /* A daemon that died without removing its socket leaves this behind. */
  int s = socket(AF_UNIX, SOCK_STREAM, 0);
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  sfmt(sa.sun_path, sizeof sa.sun_path, "%s", path);
  ck_assert_int_eq(bind(s, (struct sockaddr *)&sa, sizeof sa), 0);
  close(s);
  ck_assert_int_lt(tu_connect_raw(path), 0);
  ck_assert_int_eq(tu_daemon_start_in(&d, d.dir, NULL), 0);
  ck_assert(log_has(&d, "removed the stale socket", 1000));
  int fd = client(&d);
  close(fd);
  stop_ok(&d);
}
END_TEST

START_TEST(test_non_socket_at_path_is_left_alone) {
  char dir[200], path[300], conf[300], out[300], yaml[600];
  tu_tmpdir(dir, sizeof dir);
  sfmt(path, sizeof path, "%s/d.sock", dir);
  sfmt(conf, sizeof conf, "%s/deepepd.yaml", dir);
  sfmt(out, sizeof out, "%s/out.log", dir);
  sfmt(yaml, sizeof yaml, "socket:\n  path: %s\nbackend: host\n", path);
  ck_assert_int_eq(tu_write_file(conf, yaml), 0);
  ck_assert_int_eq(tu_write_file(path, "precious\n"), 0);
  const char *args[] = {"-c", conf, NULL};
  int st = run_deepepd(args, out);
  ck_assert(WIFEXITED(st) && WEXITSTATUS(st) == 1);
  char *text = slurp(out);
  ck_assert_msg(strstr(text, "exists and is not a socket") != NULL, "said: %s", text);
  free(text);
  text = slurp(path);
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
  sfmt(longpath, sizeof longpath, "%s/", dir);
  longpath[strlen(longpath)] = 'x';
  longpath[150] = '\0';
  char out[300];
  sfmt(out, sizeof out, "%s/out.log", dir);
  const char *args[] = {"--backend", "host", "-s", longpath, NULL};
  int st = run_deepepd(args, out);
  ck_assert(WIFEXITED(st) && WEXITSTATUS(st) == 1);
  char *text = slurp(out);
  ck_assert_msg(strstr(text, "socket path too long (150 bytes, max 107)") != NULL, "said: %s",
                text);
  free(text);
  tu_rmtree(dir);
}
END_TEST

/* READY=1 once listening, RELOADING=1 + READY=1 on SIGHUP, STOPPING=1 on SIGTERM. */
static void check_notify(bool abstract) {
  struct tu_daemon d;
  memset(&d, 0, sizeof d);
  tu_tmpdir(d.dir, sizeof d.dir);
  sfmt(d.sock, sizeof d.sock, "%s/d.sock", d.dir);
  sfmt(d.conf, sizeof d.conf, "%s/deepepd.yaml", d.dir);
  sfmt(d.log, sizeof d.log, "%s/deepepd.log", d.dir);
  char yaml[512];
  sfmt(yaml, sizeof yaml, "socket:\n  path: %s\nbackend: host\n", d.sock);
  ck_assert_int_eq(tu_write_file(d.conf, yaml), 0);
  char name[200];
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  socklen_t salen;
  if (abstract) {
    sfmt(name, sizeof name, "@deepepd-test-%d", (int)getpid());
    memcpy(sa.sun_path + 1, name + 1, strlen(name) - 1);
    salen = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + strlen(name));
  } else {
    sfmt(name, sizeof name, "%s/notify", d.dir);
    sfmt(sa.sun_path, sizeof sa.sun_path, "%s", name);
    salen = sizeof sa;
  }
  int ns = socket(AF_UNIX, SOCK_DGRAM, 0);
  ck_assert_int_eq(bind(ns, (struct sockaddr *)&sa, salen), 0);
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) {
    int fd = open(d.log, O_WRONLY | O_CREAT | O_APPEND, 0644);
    dup2(fd, 2);
    setenv("NOTIFY_SOCKET", name, 1);
    execl(tu_bin("deepepd"), "deepepd", "-c", d.conf, (char *)NULL);
    _exit(127);
  }
  d.pid = pid;
  char got[512];
  /* Collect datagrams until want arrives (5 s). */
#define EXPECT_NOTIFY(want)                                                         \
  do {                                                                              \
    bool seen = false;                                                              \
    int64_t dl = now_ms() + 5000;                                                   \
    while (!seen && now_ms() < dl) {                                                \
      struct pollfd pfd = {.fd = ns, .events = POLLIN};                             \
      if (poll(&pfd, 1, 100) <= 0)                                                  \
        continue;                                                                   \
      ssize_t n = recv(ns, got, sizeof got - 1, 0);                                 \
      ck_assert_int_gt(n, 0);                                                       \
      got[n] = '\0';                                                                \
      seen = strncmp(got, want, strlen(want)) == 0;                                 \
    }                                                                               \
    ck_assert_msg(seen, "no %s from deepepd (last: %s)", want, got);                \
  } while (0)
  EXPECT_NOTIFY("READY=1");
  /* Ready means listening. */
  int fd = client(&d);
  close(fd);
  kill(pid, SIGHUP);
  EXPECT_NOTIFY("RELOADING=1");
  EXPECT_NOTIFY("READY=1");
  kill(pid, SIGTERM);
  EXPECT_NOTIFY("STOPPING=1");
#undef EXPECT_NOTIFY
  int st;
  ck_assert_int_eq(waitpid(pid, &st, 0), pid);
  ck_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  d.pid = 0;
  close(ns);
  tu_daemon_cleanup(&d);
}

START_TEST(test_sd_notify_path) { check_notify(false); }
END_TEST

START_TEST(test_sd_notify_abstract) { check_notify(true); }
END_TEST

/* ---- signals --------------------------------------------------------------- */

START_TEST(test_sigterm_tells_clients_and_exits_cleanly) {
  struct tu_daemon d;
  start(&d, NULL);
  int fds[3];
  for (int i = 0; i < 3; i++)
    fds[i] = client(&d);
  /* One of them is waiting in a rendezvous when the daemon stops. */
  struct dep_attach_args a = {.rank = 0, .world_size = 2, .local_rank = 0,
                              .local_world_size = 2,
                              .shape = {.max_tokens_per_rank = 128, .hidden = 1024,
                                        .num_experts = 8, .topk = 2, .dtype = DEP_DTYPE_BF16}};
  sfmt(a.job_id, sizeof a.job_id, "stopping-job");
  ck_assert_int_eq(send_frame(fds[2], DEP_MSG_ATTACH, 4, &a), 0);
  ck_assert(log_has(&d, "attached (1 of 2", 3000));
  int st = tu_daemon_stop(&d);
  ck_assert_msg(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "wait status %d", st);
  struct frame *f = frame_new();
  for (int i = 0; i < 3; i++) {
    ck_assert_int_eq(recv_frame(fds[i], f, 2000), 0);
    ck_assert_str_eq(proto_type_name(f->h.type), "SHUTDOWN");
    ck_assert_uint_eq(f->h.request_id, 0);
    expect_eof(fds[i]);
    close(fds[i]);
  }
  free(f);
  ck_assert_msg(access(d.sock, F_OK) != 0 && errno == ENOENT, "the socket file is left behind");
  tu_daemon_cleanup(&d);
}
END_TEST

START_TEST(test_sighup_reloads_live_keys_and_names_the_rest) {
  struct tu_daemon d;
  start(&d, NULL);
  int fd = client(&d);
  ck_assert(!log_has(&d, "<7>", 0));
  /* Raise the log level (live) and move the socket (needs a restart). */
  char yaml[1024];
  sfmt(yaml, sizeof yaml,
           "socket:\n  path: %s/elsewhere.sock\n  mode: 0666\nbackend: host\nlog_level: debug\n",
           d.dir);
  ck_assert_int_eq(tu_write_file(d.conf, yaml), 0);
  kill(d.pid, SIGHUP);
  ck_assert(log_has(&d, "reload: needs restart: socket.path", 3000));
  /* Still here, on the old socket, and now logging at debug. */
  struct dep_status *st = status(fd);
  ck_assert_uint_eq(st->pid, (uint32_t)d.pid);
  dep_status_free(st);
  int fresh = client(&d);
  ck_assert(log_has(&d, "<7>client", 3000));
  close(fresh);
  /* A broken file is reported and the running configuration kept. */
  ck_assert_int_eq(tu_write_file(d.conf, "log_level: [\n"), 0);
  kill(d.pid, SIGHUP);
  ck_assert(log_has(&d, "keeping the running configuration", 3000));
  st = status(fd);
  dep_status_free(st);
  close(fd);
  stop_ok(&d);
}
END_TEST

/* ---- command line ---------------------------------------------------------- */

START_TEST(test_check_config) {
  char dir[200], good[300], bad[300], out[300];
  tu_tmpdir(dir, sizeof dir);
  sfmt(good, sizeof good, "%s/good.yaml", dir);
  sfmt(bad, sizeof bad, "%s/bad.yaml", dir);
  sfmt(out, sizeof out, "%s/out.log", dir);
  ck_assert_int_eq(tu_write_file(good, "backend: host\nlimits:\n  max_jobs: 8\n"), 0);
  ck_assert_int_eq(tu_write_file(bad, "backend: host\nlimits:\n  max_jobz: 8\n"), 0);
  const char *a1[] = {"--check-config", good, NULL};
  int st = run_deepepd(a1, out);
  ck_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  char *text = slurp(out);
  char want[400];
  sfmt(want, sizeof want, "%s: ok", good);
  ck_assert_msg(strstr(text, want) != NULL, "said: %s", text);
  free(text);
  const char *a2[] = {"--check-config", bad, NULL};
  st = run_deepepd(a2, out);
  ck_assert(WIFEXITED(st) && WEXITSTATUS(st) == 1);
  text = slurp(out);
  sfmt(want, sizeof want, "%s:3:3:", bad);
  ck_assert_msg(strstr(text, want) != NULL, "said: %s (wanted %s)", text, want);
  free(text);
  const char *a3[] = {"--no-such-option", NULL};
  st = run_deepepd(a3, out);
  ck_assert(WIFEXITED(st) && WEXITSTATUS(st) == 2);
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
  if (send_frame(fd, DEP_MSG_HELLO, 1, &h) != 0 && expect_allowed)
    return 12;
  static struct frame f;
  if (recv_frame(fd, &f, 5000) != 0)
    return 13;
  struct dep_msg_error e;
  if (!expect_allowed) {
    if (f.h.type != DEP_MSG_ERROR || proto_decode_error(f.body, f.h.body_len, &e) != 0)
      return 14;
    if (e.code != DEP_ERR_PERMISSION || strstr(e.message, "uid 65534 is not allowed") == NULL)
      return 15;
    return recv_frame(fd, &f, 5000) == -1 ? 0 : 16;
  }
  if (f.h.type != DEP_MSG_HELLO_OK)
    return 17;
  if (join_job == NULL) {
    if (send_frame(fd, DEP_MSG_STATUS, 2, NULL) != 0 || recv_frame(fd, &f, 5000) != 0 ||
        f.h.type != DEP_MSG_STATUS_OK)
      return 18;
    return 0;
  }
  struct dep_attach_args a = {.rank = 1, .world_size = 2, .local_rank = 1,
                              .local_world_size = 2,
                              .shape = {.max_tokens_per_rank = 128, .hidden = 1024,
                                        .num_experts = 8, .topk = 2, .dtype = DEP_DTYPE_BF16}};
  sfmt(a.job_id, sizeof a.job_id, "%s", join_job);
  if (send_frame(fd, DEP_MSG_ATTACH, 3, &a) != 0 || recv_frame(fd, &f, 5000) != 0 ||
      f.h.type != DEP_MSG_ERROR || proto_decode_error(f.body, f.h.body_len, &e) != 0)
    return 19;
  /* Refused, and told nothing about the job but that its id is taken. */
  if (e.code != DEP_ERR_PERMISSION || strstr(e.message, "world_size") != NULL ||
      strstr(e.message, "rank") != NULL)
    return 20;
  /* Nor does STATUS show another user's job. */
  struct dep_status st;
  if (send_frame(fd, DEP_MSG_STATUS, 4, NULL) != 0 || recv_frame(fd, &f, 5000) != 0 ||
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
    printf("test_allow_list: skipped: needs root to become uid %d\n", NOBODY);
    return;
  }
  struct tu_daemon d;
  start(&d, NULL);
  ck_assert_int_eq(run_as_nobody(d.sock, false, NULL), 0);
  ck_assert(log_has(&d, "uid 65534 is not allowed", 3000));
  stop_ok(&d);
  start(&d, "allow:\n  users: [\"65534\"]\n");
  ck_assert_int_eq(run_as_nobody(d.sock, true, NULL), 0);
  stop_ok(&d);
  /* By group too. */
  start(&d, "allow:\n  groups: [\"65534\"]\n");
  ck_assert_int_eq(run_as_nobody(d.sock, true, NULL), 0);
  stop_ok(&d);
}
END_TEST

/* ---- attach ---------------------------------------------------------------- */

static struct dep_attach_args job_args(const char *id, uint32_t local_rank, uint32_t lws) {
  struct dep_attach_args a = {.rank = local_rank, .world_size = lws, .local_rank = local_rank,
                              .local_world_size = lws,
                              .shape = {.max_tokens_per_rank = 128, .hidden = 1024,
                                        .num_experts = 8, .topk = 2, .dtype = DEP_DTYPE_BF16}};
  sfmt(a.job_id, sizeof a.job_id, "%s", id);
  return a;
}

static void attach(int fd, const struct dep_attach_args *a, uint32_t req) {
  ck_assert_int_eq(send_frame(fd, DEP_MSG_ATTACH, req, a), 0);
}

/*
 * The ATTACH reply: SLAB frames (one arena per device, its chunk fds riding
 * on it, naming the local ranks whose slabs it holds), then ATTACH_OK.  On
 * the host backend there is one device, so one arena holds every slab.
 */
static void expect_attach_ok(int fd, uint32_t req, uint32_t lws) {
  bool seen[DEP_MAX_LOCAL_RANKS] = {false};
  int fds[DEP_PROTO_MAX_FDS];
  int nfds = 0;
  struct frame *sf = frame_new();
  ck_assert_int_eq(recv_frame_fds(fd, sf, 5000, fds, &nfds), 0);
  ck_assert_str_eq(proto_type_name(sf->h.type), "SLAB");
  ck_assert_uint_eq(sf->h.request_id, req);
  struct dep_msg_slab m;
  ck_assert_int_eq(proto_decode_slab(sf->body, sf->h.body_len, &m), 0);
  ck_assert_uint_eq(m.n_ranks, lws);
  for (uint32_t i = 0; i < m.n_ranks; i++) {
    ck_assert_uint_lt(m.ranks[i].local_rank, lws);
    ck_assert(!seen[m.ranks[i].local_rank]);
    seen[m.ranks[i].local_rank] = true;
    ck_assert_uint_lt(m.ranks[i].offset, m.chunk_bytes * m.n_chunks);
  }
  ck_assert_int_eq((int)m.n_chunks, nfds);
  for (int k = 0; k < nfds; k++) {
    struct stat sb;
    ck_assert_int_eq(fstat(fds[k], &sb), 0);
    ck_assert_uint_eq((uint64_t)sb.st_size, m.chunk_bytes);
    close(fds[k]);
  }
  free(sf);
  struct frame *f = frame_new();
  ck_assert_int_eq(recv_frame(fd, f, 5000), 0);
  ck_assert_str_eq(proto_type_name(f->h.type), "ATTACH_OK");
  ck_assert_uint_eq(f->h.request_id, req);
  struct dep_msg_attach_ok ok;
  ck_assert_int_eq(proto_decode_attach_ok(f->body, f->h.body_len, &ok), 0);
  ck_assert_uint_eq(ok.local_world_size, lws);
  ck_assert_uint_eq(ok.num_fds, 0);
  ck_assert_str_eq(ok.backend, "host");
  ck_assert_uint_eq(ok.op_timeout_ms, 10000); /* limits.op_timeout_ms, default */
  free(f);
}

START_TEST(test_attach_rendezvous) {
  struct tu_daemon d;
  start(&d, NULL);
  int obs = client(&d);
  int fds[4];
  for (uint32_t i = 0; i < 4; i++)
    fds[i] = client(&d);
  for (uint32_t i = 0; i < 3; i++) {
    struct dep_attach_args a = job_args("train-1", i, 4);
    attach(fds[i], &a, 20 + i);
  }
  /* Three of four: nobody hears anything yet. */
  for (uint32_t i = 0; i < 3; i++)
    expect_silence(fds[i], 150);
  uint32_t at = 0, ex = 0;
  ck_assert(job_listed(obs, "train-1", &at, &ex));
  ck_assert_uint_eq(at, 3);
  ck_assert_uint_eq(ex, 4);
  struct dep_attach_args a = job_args("train-1", 3, 4);
  attach(fds[3], &a, 23);
  for (uint32_t i = 0; i < 4; i++)
    expect_attach_ok(fds[i], 20 + i, 4);
  ck_assert(job_listed(obs, "train-1", &at, &ex));
  ck_assert_uint_eq(at, 4);
  ck_assert_uint_eq(ex, 4);
  /* A running job takes no newcomers; a connection attaches once. */
  int late = client(&d);
  attach(late, &a, 30);
  expect_error(late, DEP_ERR_STATE, NULL, 0);
  struct dep_attach_args other = job_args("train-2", 0, 2);
  attach(fds[0], &other, 31);
  expect_error(fds[0], DEP_ERR_STATE, NULL, 0);
  /* DETACH frees the rank; closing the rest removes the job. */
  ck_assert_int_eq(send_frame(fds[0], DEP_MSG_DETACH, 32, NULL), 0);
  struct frame *f = frame_new();
  ck_assert_int_eq(recv_frame(fds[0], f, 5000), 0);
  ck_assert_str_eq(proto_type_name(f->h.type), "DETACH_OK");
  free(f);
  ck_assert(job_listed(obs, "train-1", &at, NULL));
  ck_assert_uint_eq(at, 3);
  for (uint32_t i = 1; i < 4; i++)
    close(fds[i]);
  ck_assert(job_gone(obs, "train-1"));
  ck_assert(log_has(&d, "job train-1: removed (no ranks left)", 3000));
  close(fds[0]);
  close(late);
  close(obs);
  stop_ok(&d);
}
END_TEST

START_TEST(test_attach_conflicts) {
  struct tu_daemon d;
  start(&d, NULL);
  int r0 = client(&d), x = client(&d), obs = client(&d);
  char msg[DEP_MSG_TEXT_MAX];
  struct dep_attach_args a = job_args("job-c", 0, 4);
  attach(r0, &a, 1);
  /* A different shape. */
  struct dep_attach_args b = job_args("job-c", 1, 4);
  b.shape.hidden = 2048;
  attach(x, &b, 2);
  expect_error(x, DEP_ERR_MISMATCH, msg, sizeof msg);
  ck_assert_msg(strstr(msg, "hidden 2048") && strstr(msg, "give 1024"), "said: %s", msg);
  b = job_args("job-c", 1, 8);
  b.world_size = 8;
  attach(x, &b, 3);
  expect_error(x, DEP_ERR_MISMATCH, msg, sizeof msg);
  ck_assert_msg(strstr(msg, "world_size 8"), "said: %s", msg);
  /* The same local rank twice, the same global rank twice. */
  b = job_args("job-c", 0, 4);
  attach(x, &b, 4);
  expect_error(x, DEP_ERR_EXISTS, msg, sizeof msg);
  ck_assert_msg(strstr(msg, "local rank 0 of job job-c is already attached by pid"), "said: %s",
                msg);
  b = job_args("job-c", 2, 4);
  b.rank = 0;
  attach(x, &b, 5);
  expect_error(x, DEP_ERR_EXISTS, msg, sizeof msg);
  ck_assert_msg(strstr(msg, "rank 0 of job job-c is already attached"), "said: %s", msg);
  /* Fields out of range are refused before the job table sees them. */
  b = job_args("job-c", 5, 4);
  attach(x, &b, 6);
  expect_error(x, DEP_ERR_INVALID, NULL, 0);
  /* None of that disturbed the waiting rank or the job. */
  expect_silence(r0, 50);
  ck_assert(wait_attached(obs, "job-c", 1));
  /* A rank that leaves while others wait frees its slot for a successor. */
  b = job_args("job-c", 1, 4);
  attach(x, &b, 7);
  ck_assert(wait_attached(obs, "job-c", 2));
  close(x);
  ck_assert(wait_attached(obs, "job-c", 1));
  int y = client(&d);
  attach(y, &b, 8);
  ck_assert(wait_attached(obs, "job-c", 2));
  expect_silence(y, 50);
  /* Closing every rank removes the job. */
  close(y);
  close(r0);
  ck_assert(job_gone(obs, "job-c"));
  close(obs);
  stop_ok(&d);
}
END_TEST

START_TEST(test_attach_timeout) {
  struct tu_daemon d;
  start(&d, "limits:\n  attach_timeout_ms: 300\n");
  int r0 = client(&d), r1 = client(&d), obs = client(&d);
  struct dep_attach_args a = job_args("slow-job", 0, 4);
  attach(r0, &a, 1);
  a = job_args("slow-job", 1, 4);
  attach(r1, &a, 2);
  int64_t t0 = now_ms();
  char msg[DEP_MSG_TEXT_MAX];
  expect_error(r0, DEP_ERR_TIMEOUT, msg, sizeof msg);
  ck_assert_msg(strstr(msg, "2 of 4 local ranks attached after 300 ms; missing local ranks 2,3"),
                "said: %s", msg);
  expect_error(r1, DEP_ERR_TIMEOUT, NULL, 0);
  ck_assert_int_lt(now_ms() - t0, 2000);
  ck_assert(!job_listed(obs, "slow-job", NULL, NULL));
  /* The connections stay usable: the job can be tried again. */
  a = job_args("slow-job", 0, 1);
  attach(r0, &a, 3);
  expect_attach_ok(r0, 3, 1);
  close(r0);
  close(r1);
  close(obs);
  stop_ok(&d);
}
END_TEST

START_TEST(test_job_of_another_uid_cannot_be_joined) {
  if (getuid() != 0) {
    printf("test_job_of_another_uid_cannot_be_joined: skipped: needs root to become uid %d\n",
           NOBODY);
    return;
  }
  struct tu_daemon d;
  start(&d, "allow:\n  users: [\"65534\"]\n");
  int r0 = client(&d);
  struct dep_attach_args a = job_args("root-job", 0, 2);
  a.world_size = 2;
  attach(r0, &a, 1);
  ck_assert(log_has(&d, "attached (1 of 2", 3000));
  ck_assert_int_eq(run_as_nobody(d.sock, true, "root-job"), 0);
  ck_assert(log_has(&d, "tried to join a job of uid 0", 3000));
  uint32_t at = 0;
  ck_assert(job_listed(r0, "root-job", &at, NULL));
  ck_assert_uint_eq(at, 1);
  close(r0);
  stop_ok(&d);
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
        test_client_that_does_not_read_is_dropped, test_max_clients,
        test_out_of_fds_pauses_accepting, NULL}},
      {"socket",
       {test_second_daemon_refuses_to_start, test_stale_socket_is_reclaimed,
        test_non_socket_at_path_is_left_alone, test_socket_path_too_long_fails_loudly,
        test_sd_notify_path, test_sd_notify_abstract, NULL}},
      {"signals",
       {test_sigterm_tells_clients_and_exits_cleanly,
        test_sighup_reloads_live_keys_and_names_the_rest, test_check_config, NULL}},
      {"auth", {test_allow_list, test_job_of_another_uid_cannot_be_joined, NULL}},
      {"attach", {test_attach_rendezvous, test_attach_conflicts, test_attach_timeout, NULL}},
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
