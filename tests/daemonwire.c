/*
 * daemonwire.c — the raw-protocol side of the daemon tests (check_daemon.c,
 * check_job.c): frames sent and read with proto_* on a plain Unix socket,
 * with deadlines, so that those suites speak to deepepd without the client
 * library, plus starting, stopping and running the daemon.  Helpers fail
 * the calling test with ck_assert where a test could not go on.
 */
#include "daemonwire.h"

#include <check.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "fdpass.h"

/* snprintf that fails the test rather than truncate a path or a message. */
void dw_sfmt(char *buf, size_t len, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(buf, len, fmt, ap);
  va_end(ap);
  ck_assert_msg(n >= 0 && (size_t)n < len, "%zu bytes are too few for \"%s\"", len, fmt);
}

int64_t dw_now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

void dw_sleep_ms(int ms) {
  struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

int dw_send_all(int fd, const void *buf, size_t len) {
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

int dw_send_frame(int fd, uint16_t type, uint32_t req, const void *msg) {
  struct proto_buf b;
  proto_buf_init(&b);
  int rc = proto_frame_encode(&b, type, 0, req, msg);
  if (rc == 0)
    rc = dw_send_all(fd, b.data, b.len);
  proto_buf_free(&b);
  return rc;
}

/* Read exactly len bytes by the deadline: 0, -1 EOF/error, -2 timeout. */
/* Read len bytes; fds that ride on them are appended to fds[*nfds] (when fds != NULL). */
static int read_exact_fds(int fd, void *buf, size_t len, int64_t deadline, int *fds, int *nfds) {
  uint8_t *p = buf;
  while (len > 0) {
    int64_t left = deadline - dw_now_ms();
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

/* One frame within timeout_ms: 0, -1 EOF, -2 timeout, -3 bad header. */
int dw_recv_frame(int fd, struct dw_frame *f, int timeout_ms) {
  int64_t deadline = dw_now_ms() + timeout_ms;
  uint8_t hdr[DEP_PROTO_HDR_LEN];
  int rc = read_exact(fd, hdr, sizeof hdr, deadline);
  if (rc != 0)
    return rc;
  if (proto_hdr_decode(hdr, DEP_PROTO_MAX_BODY, &f->h, NULL, 0) != 0)
    return -3;
  return read_exact(fd, f->body, f->h.body_len, deadline);
}

/* As dw_recv_frame, collecting the fds that ride on the frame. */
int dw_recv_frame_fds(int fd, struct dw_frame *f, int timeout_ms, int *fds, int *nfds) {
  int64_t deadline = dw_now_ms() + timeout_ms;
  uint8_t hdr[DEP_PROTO_HDR_LEN];
  int rc = read_exact_fds(fd, hdr, sizeof hdr, deadline, fds, nfds);
  if (rc != 0)
    return rc;
  if (proto_hdr_decode(hdr, DEP_PROTO_MAX_BODY, &f->h, NULL, 0) != 0)
    return -3;
  return read_exact(fd, f->body, f->h.body_len, deadline);
}

struct dw_frame *dw_frame_new(void) {
  struct dw_frame *f = malloc(sizeof *f);
  ck_assert_ptr_nonnull(f);
  return f;
}

/* Expect an ERROR frame with this code; its message goes to msg. */
void dw_expect_attach_ok(int fd, uint32_t req, struct dep_msg_attach_ok *ok) {
  struct dw_frame *f = dw_frame_new();
  do {
    int fds[DEP_PROTO_MAX_FDS], nfds = 0;
    ck_assert_int_eq(dw_recv_frame_fds(fd, f, 5000, fds, &nfds), 0);
    for (int i = 0; i < nfds; i++)
      close(fds[i]);
  } while (f->h.type == DEP_MSG_SLAB);
  if (f->h.type == DEP_MSG_ERROR) {
    struct dep_msg_error e;
    ck_assert_int_eq(proto_decode_error(f->body, f->h.body_len, &e), 0);
    ck_abort_msg("ATTACH failed: %s: %s", dep_strerror(e.code), e.message);
  }
  ck_assert_msg(f->h.type == DEP_MSG_ATTACH_OK, "got %s where ATTACH_OK was expected",
                proto_type_name(f->h.type));
  ck_assert_uint_eq(f->h.request_id, req);
  if (ok != NULL)
    ck_assert_int_eq(proto_decode_attach_ok(f->body, f->h.body_len, ok), 0);
  free(f);
}

void dw_expect_error(int fd, int code, char *msg, size_t len) {
  struct dw_frame *f = dw_frame_new();
  int rc = dw_recv_frame(fd, f, 5000);
  ck_assert_msg(rc == 0, "no reply (rc %d) where an error %s was expected", rc,
                dep_errname(code));
  ck_assert_msg(f->h.type == DEP_MSG_ERROR, "got %s where an error %s was expected",
                proto_type_name(f->h.type), dep_errname(code));
  struct dep_msg_error e;
  ck_assert_int_eq(proto_decode_error(f->body, f->h.body_len, &e), 0);
  ck_assert_msg(e.code == code, "error %s (%s) where %s was expected", dep_errname(e.code),
                e.message, dep_errname(code));
  if (msg != NULL)
    dw_sfmt(msg, len, "%s", e.message);
  free(f);
}

/* The peer sends nothing more and closes (a pending reply would be a failure). */
void dw_expect_eof(int fd) {
  struct dw_frame *f = dw_frame_new();
  int rc = dw_recv_frame(fd, f, 5000);
  ck_assert_msg(rc == -1, "expected the daemon to close the connection, got rc %d (type %s)", rc,
                rc == 0 ? proto_type_name(f->h.type) : "-");
  free(f);
}

/* Nothing arrives within ms (the connection stays open). */
void dw_expect_silence(int fd, int ms) {
  struct pollfd pfd = {.fd = fd, .events = POLLIN};
  ck_assert_msg(poll(&pfd, 1, ms) == 0, "a reply arrived where none was due yet");
}

void dw_hello_as(int fd, uint32_t version) {
  struct dep_msg_hello h = {.version = version, .pid = (uint32_t)getpid()};
  dw_sfmt(h.name, sizeof h.name, "check_daemon");
  ck_assert_int_eq(dw_send_frame(fd, DEP_MSG_HELLO, 1, &h), 0);
}

void dw_expect_hello_ok(int fd) {
  struct dw_frame *f = dw_frame_new();
  ck_assert_int_eq(dw_recv_frame(fd, f, 5000), 0);
  ck_assert_str_eq(proto_type_name(f->h.type), "HELLO_OK");
  struct dep_msg_hello_ok ok;
  ck_assert_int_eq(proto_decode_hello_ok(f->body, f->h.body_len, &ok), 0);
  ck_assert_uint_eq(ok.version, DEP_PROTO_VERSION);
  ck_assert_str_eq(ok.daemon_version, DEP_VERSION_STRING);
  free(f);
}

/* A connected, greeted client. */
int dw_client(const struct tu_daemon *d) {
  int fd = tu_connect_raw(d->sock);
  ck_assert_msg(fd >= 0, "cannot connect to %s", d->sock);
  dw_hello_as(fd, DEP_PROTO_VERSION);
  dw_expect_hello_ok(fd);
  return fd;
}

struct dep_status *dw_recv_status(int fd, uint32_t req) {
  struct dw_frame *f = dw_frame_new();
  ck_assert_int_eq(dw_recv_frame(fd, f, 5000), 0);
  ck_assert_str_eq(proto_type_name(f->h.type), "STATUS_OK");
  ck_assert_uint_eq(f->h.request_id, req);
  struct dep_status *st = calloc(1, sizeof *st);
  ck_assert_int_eq(proto_decode_status(f->body, f->h.body_len, st), 0);
  free(f);
  return st;
}

struct dep_status *dw_status(int fd) {
  ck_assert_int_eq(dw_send_frame(fd, DEP_MSG_STATUS, 7, NULL), 0);
  return dw_recv_status(fd, 7);
}

void dw_reload(int fd, uint32_t req, struct dep_msg_reload_ok *out) {
  ck_assert_int_eq(dw_send_frame(fd, DEP_MSG_RELOAD, req, NULL), 0);
  struct dw_frame *f = dw_frame_new();
  ck_assert_int_eq(dw_recv_frame(fd, f, 5000), 0);
  ck_assert_str_eq(proto_type_name(f->h.type), "RELOAD_OK");
  ck_assert_uint_eq(f->h.request_id, req);
  ck_assert_int_eq(proto_decode_reload_ok(f->body, f->h.body_len, out), 0);
  free(f);
}

/* Whether a fresh STATUS lists the job; *attached / *expected filled. */
bool dw_job_listed(int fd, const char *id, uint32_t *attached, uint32_t *expected) {
  struct dep_status *st = dw_status(fd);
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

/* Wait (up to timeout_ms) for the daemon's log to contain needle. */
bool dw_log_has(const struct tu_daemon *d, const char *needle, int timeout_ms) {
  int64_t deadline = dw_now_ms() + timeout_ms;
  do {
    char *log = tu_daemon_log(d);
    bool found = strstr(log, needle) != NULL;
    free(log);
    if (found)
      return true;
    dw_sleep_ms(20);
  } while (dw_now_ms() < deadline);
  return false;
}

void dw_start(struct tu_daemon *d, const char *extra_yaml) {
  ck_assert_msg(tu_daemon_start(d, extra_yaml) == 0, "deepepd did not start");
}

void dw_stop_ok(struct tu_daemon *d) {
  int st = tu_daemon_stop(d);
  ck_assert_msg(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0,
                "deepepd did not exit cleanly (wait status %d)", st);
  tu_daemon_cleanup(d);
}

int dw_start_notifying(struct tu_daemon *d, bool abstract) {
  memset(d, 0, sizeof *d);
  tu_tmpdir(d->dir, sizeof d->dir);
  dw_sfmt(d->sock, sizeof d->sock, "%s/d.sock", d->dir);
  dw_sfmt(d->conf, sizeof d->conf, "%s/deepepd.yaml", d->dir);
  dw_sfmt(d->log, sizeof d->log, "%s/deepepd.log", d->dir);
  char yaml[600];
  /* A small pool: the default 1 GiB takes longer than dw_expect_notify waits
   * to make on a busy two-core machine. */
  dw_sfmt(yaml, sizeof yaml,
          "socket:\n  path: %s\nbackend: host\npool:\n  host_size: 64MiB\n  chunk_size: 2MiB\n",
          d->sock);
  ck_assert_int_eq(tu_write_file(d->conf, yaml), 0);
  char name[200];
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  socklen_t salen;
  if (abstract) {
    dw_sfmt(name, sizeof name, "@deepepd-test-%d", (int)getpid());
    memcpy(sa.sun_path + 1, name + 1, strlen(name) - 1);
    salen = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + strlen(name));
  } else {
    dw_sfmt(name, sizeof name, "%s/notify", d->dir);
    dw_sfmt(sa.sun_path, sizeof sa.sun_path, "%s", name);
    salen = sizeof sa;
  }
  int ns = socket(AF_UNIX, SOCK_DGRAM, 0);
  ck_assert_int_ge(ns, 0);
  ck_assert_int_eq(bind(ns, (struct sockaddr *)&sa, salen), 0);
  fflush(NULL);
  d->pid = fork();
  ck_assert_int_ge(d->pid, 0);
  if (d->pid == 0) {
    int fd = open(d->log, O_WRONLY | O_CREAT | O_APPEND, 0644);
    dup2(fd, 2);
    setenv("NOTIFY_SOCKET", name, 1);
    execl(tu_bin("deepepd"), "deepepd", "-c", d->conf, (char *)NULL);
    _exit(127);
  }
  return ns;
}

void dw_expect_notify(int ns, const char *want) {
  char got[512] = "";
  const size_t len = strlen(want);
  bool seen = false;
  for (int64_t dl = dw_now_ms() + 15000; !seen && dw_now_ms() < dl;) {
    struct pollfd pfd = {.fd = ns, .events = POLLIN};
    if (poll(&pfd, 1, 100) <= 0)
      continue;
    ssize_t n = recv(ns, got, sizeof got - 1, 0);
    ck_assert_int_gt(n, 0);
    got[n] = '\0';
    seen = strncmp(got, want, len) == 0 && (got[len] == '\0' || got[len] == '\n');
  }
  ck_assert_msg(seen, "no \"%s\" from deepepd (last: %s)", want, got);
}

/* Run deepepd with args, output to out_path; returns its wait status. */
int dw_run_deepepd(const char *const args[], const char *out_path) {
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
    dw_sleep_ms(10);
  }
  kill(pid, SIGKILL);
  waitpid(pid, &st, 0);
  ck_abort_msg("deepepd %s did not exit within 10 s", args[0]);
  return -1;
}

void dw_deepepd_exits(const char *const args[], const char *out_path, int code, const char *want) {
  int st = dw_run_deepepd(args, out_path);
  char *text = dw_slurp(out_path);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == code,
                "deepepd %s: wait status 0x%x, want exit %d; it said: %s", args[0], st, code, text);
  ck_assert_msg(want == NULL || strstr(text, want) != NULL, "deepepd %s said: %s (want %s)",
                args[0], text, want);
  free(text);
}

/* A whole (small) file as a string; the caller frees it. */
char *dw_slurp(const char *path) {
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

struct dep_attach_args dw_job_args(const char *id, uint32_t local_rank, uint32_t lws) {
  struct dep_attach_args a = {.size = sizeof a,
                              .rank = local_rank, .world_size = lws, .local_rank = local_rank,
                              .local_world_size = lws,
                              .shape = {.max_tokens_per_rank = 128, .hidden = 1024,
                                        .num_experts = 8, .topk = 2, .dtype = DEP_DTYPE_BF16}};
  dw_sfmt(a.job_id, sizeof a.job_id, "%s", id);
  return a;
}

void dw_attach(int fd, const struct dep_attach_args *a, uint32_t req) {
  ck_assert_int_eq(dw_send_frame(fd, DEP_MSG_ATTACH, req, a), 0);
}

int dw_open_fds(void) {
  DIR *d = opendir("/proc/self/fd");
  ck_assert_ptr_nonnull(d);
  int n = 0;
  for (struct dirent *e; (e = readdir(d)) != NULL;)
    if (e->d_name[0] != '.')
      n++;
  closedir(d);
  return n;
}

pid_t dw_fork_stdout_to(const char *path) {
  fflush(NULL);
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) {
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0)
      _exit(126);
    dup2(fd, 1);
    close(fd);
  }
  return pid;
}

int dw_run_ctl(const char *bin, const char *dir, char **out, const char *const *args) {
  char path[300];
  dw_sfmt(path, sizeof path, "%s/ctl.out", dir);
  const char *argv[12] = {"deepepctl"};
  int n = 1;
  for (; args[n - 1] != NULL && n < 11; n++)
    argv[n] = args[n - 1];
  argv[n] = NULL;
  if (bin == NULL)
    bin = tu_bin("deepepctl");
  pid_t pid = dw_fork_stdout_to(path);
  if (pid == 0) {
    unsetenv(DEP_SOCKET_ENV);
    execv(bin, (char *const *)argv);
    _exit(127);
  }
  int st = 0;
  ck_assert_int_eq(waitpid(pid, &st, 0), pid);
  ck_assert(WIFEXITED(st));
  *out = dw_slurp(path);
  return WEXITSTATUS(st);
}

void dw_child_fork(struct dw_child *c) {
  int rep[2], go[2];
  ck_assert_int_eq(pipe(rep), 0);
  ck_assert_int_eq(pipe(go), 0);
  fflush(NULL);
  c->pid = fork();
  ck_assert_int_ge(c->pid, 0);
  if (c->pid == 0) {
    close(rep[0]);
    close(go[1]);
    c->rep = rep[1];
    c->go = go[0];
    return;
  }
  close(rep[1]);
  close(go[0]);
  c->rep = rep[0];
  c->go = go[1];
}
