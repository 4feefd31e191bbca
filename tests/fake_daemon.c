/*
 * fake_daemon.c — a scripted stand-in for deepepd, for the client tests: it
 * does, on purpose, what a real daemon never should (wrong request ids,
 * unexpected types, fds that disagree with their frame), so the tests can
 * show that libdeepep-client refuses each with the right code and leaks
 * nothing.  It runs in a forked process and serves one script.
 */
#include "fake_daemon.h"

#include <check.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "fdpass.h"
#include "proto.h"
#include "testutil.h"

/* A Unix stream socket bound to path (not listening). */
int fake_daemon_bind(const char *path) {
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  size_t len = strlen(path);
  ck_assert_uint_lt(len, sizeof sa.sun_path);
  memcpy(sa.sun_path, path, len + 1);
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ck_assert_int_ge(fd, 0);
  ck_assert_int_eq(bind(fd, (struct sockaddr *)&sa, sizeof sa), 0);
  return fd;
}

static int fake_read(int fd, struct dep_frame_hdr *h) {
  uint8_t hdr[DEP_PROTO_HDR_LEN], body[4096];
  if (recv(fd, hdr, sizeof hdr, MSG_WAITALL) != (ssize_t)sizeof hdr)
    return -1;
  if (proto_hdr_decode(hdr, sizeof body, h, NULL, 0) != 0)
    return -1;
  if (h->body_len > 0 && recv(fd, body, h->body_len, MSG_WAITALL) != (ssize_t)h->body_len)
    return -1;
  return 0;
}

static void fake_send(int fd, uint16_t type, uint32_t id, const void *msg, const int *fds,
                      int nfds) {
  struct proto_buf b;
  proto_buf_init(&b);
  if (proto_frame_encode(&b, type, nfds > 0 ? DEP_FRAME_F_FDS : 0, id, msg) != 0 ||
      fdpass_send(fd, b.data, b.len, fds, nfds) != (ssize_t)b.len)
    _exit(3);
  proto_buf_free(&b);
}

/* As fake_send, with the header's u16 at off (4: version, 6: type) then set to v. */
static void fake_send_as(int fd, uint16_t type, uint32_t id, const void *msg, size_t off,
                         uint16_t v) {
  struct proto_buf b;
  proto_buf_init(&b);
  if (proto_frame_encode(&b, type, 0, id, msg) != 0)
    _exit(3);
  b.data[off] = (uint8_t)v;
  b.data[off + 1] = (uint8_t)(v >> 8);
  if (fdpass_send(fd, b.data, b.len, NULL, 0) != (ssize_t)b.len)
    _exit(3);
  proto_buf_free(&b);
}

/* Whether the process at the other end of fd maps a memfd named "slab". */
static bool peer_maps_slab(int fd) {
  struct ucred cr;
  socklen_t len = sizeof cr;
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &len) != 0)
    _exit(7);
  char path[64], line[512];
  snprintf(path, sizeof path, "/proc/%d/maps", (int)cr.pid);
  FILE *f = fopen(path, "r");
  if (f == NULL)
    _exit(7);
  bool mapped = false;
  while (fgets(line, sizeof line, f) != NULL)
    mapped = mapped || strstr(line, "/memfd:slab") != NULL;
  fclose(f);
  return mapped;
}

static void fake_serve(int lfd, enum fake_script script) {
  if (script == FAKE_REFUSE) {
    /* What deepepd does to a user it does not allow: say why, then close,
     * whether or not the client's HELLO has arrived yet. */
    struct dep_msg_error e = {.code = DEP_ERR_PERMISSION};
    snprintf(e.message, sizeof e.message, "uid 4242 is not allowed by the fake deepepd");
    for (int i = 0; i < FAKE_REFUSALS; i++) {
      int fd = accept(lfd, NULL, NULL);
      if (fd < 0)
        _exit(2);
      fake_send(fd, DEP_MSG_ERROR, 0, &e, NULL, 0);
      close(fd);
    }
    _exit(0);
  }
  int fd = accept(lfd, NULL, NULL);
  if (fd < 0)
    _exit(2);
  struct dep_frame_hdr h;
  int verdict = 0;
  if (fake_read(fd, &h) != 0 || h.type != DEP_MSG_HELLO)
    _exit(4);
  struct dep_msg_hello_ok ok = {.version = DEP_PROTO_VERSION};
  snprintf(ok.daemon_version, sizeof ok.daemon_version, "fake");
  snprintf(ok.backend, sizeof ok.backend, "%s", script == FAKE_CUDA_SILENT ? "cuda" : "host");
  if (script == FAKE_CUDA_SILENT) {
    fake_send(fd, DEP_MSG_HELLO_OK, h.request_id, &ok, NULL, 0);
    if (fake_read(fd, &h) == 0)
      verdict = 7;
  } else if (script == FAKE_BAD_REQUEST_ID) {
    fake_send(fd, DEP_MSG_HELLO_OK, h.request_id + 7, &ok, NULL, 0);
  } else if (script == FAKE_VERSION_ERROR || script == FAKE_OTHER_VERSION) {
    struct dep_msg_error e = {.code = DEP_ERR_VERSION};
    snprintf(e.message, sizeof e.message, "fake deepepd speaks protocol 9, you speak 1");
    if (script == FAKE_OTHER_VERSION)
      fake_send_as(fd, DEP_MSG_ERROR, h.request_id, &e, 4, DEP_PROTO_VERSION + 3);
    else
      fake_send(fd, DEP_MSG_ERROR, h.request_id, &e, NULL, 0);
  } else {
    fake_send(fd, DEP_MSG_HELLO_OK, h.request_id, &ok, NULL, 0);
    if (fake_read(fd, &h) != 0)
      _exit(5);
    if (script == FAKE_SHUTDOWN)
      fake_send(fd, DEP_MSG_SHUTDOWN, 0, NULL, NULL, 0);
    else if (script == FAKE_WRONG_TYPE)
      fake_send(fd, DEP_MSG_DETACH_OK, h.request_id, NULL, NULL, 0);
    else if (script == FAKE_UNKNOWN_REPLY)
      fake_send_as(fd, DEP_MSG_ERROR, h.request_id,
                   &(struct dep_msg_error){.code = DEP_ERR_INTERNAL, .message = "a body"}, 6,
                   DEP_MSG_TYPE_MAX_ + 5);
    else if (script == FAKE_ATTACH_FDS || script == FAKE_ATTACH_FDS_LIE ||
             script == FAKE_ATTACH_UNMAP) {
      /* One arena of two 1 MiB memfd chunks holding both local ranks'
       * slabs (1 MiB each: more than the test shape's layout needs), then
       * ATTACH_OK; the lie announces an fd on ATTACH_OK that does not come. */
      const uint64_t chunk = 1u << 20;
      int mfds[2];
      for (int k = 0; k < 2; k++) {
        mfds[k] = memfd_create("slab", MFD_CLOEXEC);
        ck_assert_int_eq(ftruncate(mfds[k], (off_t)chunk), 0);
      }
      struct dep_msg_slab sl = {.chunk_bytes = chunk, .n_chunks = 2, .n_ranks = 2,
                                .ranks = {{0, 0, 0}, {1, 1, chunk}}};
      fake_send(fd, DEP_MSG_SLAB, h.request_id, &sl, mfds, 2);
      close(mfds[0]);
      close(mfds[1]);
      struct dep_msg_attach_ok a = {.slab_bytes = chunk, .local_world_size = 2,
                                    .num_fds = script == FAKE_ATTACH_FDS_LIE ? 1 : 0,
                                    .op_timeout_ms = 1000};
      snprintf(a.backend, sizeof a.backend, "host");
      fake_send(fd, DEP_MSG_ATTACH_OK, h.request_id, &a, NULL, 0);
      /* The client asks for its stats page next: this daemon has none to lend, as one older
       * than STATS_LEND answers. */
      bool more = script != FAKE_ATTACH_FDS_LIE && fake_read(fd, &h) == 0;
      if (more && h.type == DEP_MSG_STATS_LEND) {
        struct dep_msg_error e = {.code = DEP_ERR_UNSUPPORTED};
        snprintf(e.message, sizeof e.message, "clients may not send STATS_LEND frames");
        fake_send(fd, DEP_MSG_ERROR, h.request_id, &e, NULL, 0);
        more = fake_read(fd, &h) == 0;
      }
      if (more && h.type == DEP_MSG_DETACH) {
        /* Once a daemon hears DETACH it may scrub the memory and lend it
         * to another job: the client must have let go of it by then. */
        if (script == FAKE_ATTACH_UNMAP && peer_maps_slab(fd))
          verdict = 6;
        fake_send(fd, DEP_MSG_DETACH_OK, h.request_id, NULL, NULL, 0);
      }
    }
  }
  /* Hold the connection until the client closes it. */
  char byte;
  while (read(fd, &byte, 1) > 0)
    ;
  _exit(verdict);
}

/* Start a fake daemon on dir/fake.sock; returns its pid. */
void fake_daemon_start(struct fake_daemon *f, enum fake_script script) {
  tu_tmpdir(f->dir, sizeof f->dir);
  snprintf(f->sock, sizeof f->sock, "%s/fake.sock", f->dir);
  int lfd = fake_daemon_bind(f->sock);
  ck_assert_int_eq(listen(lfd, 4), 0);
  f->pid = fork();
  ck_assert_int_ge(f->pid, 0);
  if (f->pid == 0)
    fake_serve(lfd, script);
  close(lfd);
}

int fake_daemon_wait(struct fake_daemon *f) {
  int st = 0;
  ck_assert_int_eq(waitpid(f->pid, &st, 0), f->pid);
  tu_rmtree(f->dir);
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

void fake_daemon_stop(struct fake_daemon *f) {
  kill(f->pid, SIGKILL);
  waitpid(f->pid, NULL, 0);
  tu_rmtree(f->dir);
}
