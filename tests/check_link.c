/*
 * check_link.c — the framed link (daemon/link.c) on its own: one end of a
 * socketpair (or of a TCP loopback connection) is the link, driven by its
 * own uv loop with test callbacks; the other end is the test, writing and
 * reading raw bytes.  What the daemon does with client frames is specified
 * against real daemons in check_daemon.c and check_server.c; this suite
 * pins the framing and closing rules every user of a link relies on.
 */
#include <arpa/inet.h>
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>
#include <uv.h>

#include "daemonwire.h"
#include "fdpass.h"
#include "link.h"
#include "log.h"
#include "proto.h"

/* One link under test, what its callbacks saw, and the test's end. */
struct world {
  uv_loop_t loop;
  struct link link;
  struct link_ops ops;
  struct link_limits lim; /* what the limits callback answers, changed at will */
  int far;                /* the test's end of the connection */

  int frames;
  struct dep_frame_hdr hdr[8]; /* the first frames seen */
  uint8_t body[8][256];
  size_t len[8];
  int nfds;                    /* fds that came with the last frame */
  struct stat fd_st;           /* what the first of them refers to */
  bool close_in_frame;         /* on_frame closes the link (and tries again) */

  int closings, closes;
  bool body_at_closing; /* a body buffer was allocated when on_closing ran */
  char log[4096];       /* what the link logged (stderr captured) */
  int log_fd;
};

static void w_limits(const struct link *l, struct link_limits *out) {
  const struct world *w = l->user;
  *out = w->lim;
}

static void w_describe(const struct link *l, char *buf, size_t len) {
  snprintf(buf, len, "test link");
}

static void w_on_frame(struct link *l, const struct dep_frame_hdr *h, const uint8_t *body,
                       size_t len, int *fds, int nfds) {
  struct world *w = l->user;
  if (w->frames < 8) {
    w->hdr[w->frames] = *h;
    w->len[w->frames] = len;
    if (len > 0) /* an empty body is NULL */
      memcpy(w->body[w->frames], body, len < 256 ? len : 256);
  }
  w->frames++;
  w->nfds = nfds;
  if (nfds > 0)
    ck_assert_int_eq(fstat(fds[0], &w->fd_st), 0);
  if (w->close_in_frame) {
    link_close(l, "the test closes it from on_frame");
    ck_assert_int_eq(w->closes, 0); /* deferred */
    link_close(l, "and again");
    link_drop(l, "and drops it");
    link_fail(l, h->request_id, DEP_ERR_STATE, "and fails it");
    ck_assert_int_eq(link_send(l, DEP_MSG_STATUS, 1, NULL, NULL, 0), DEP_ERR_DAEMON_GONE);
  }
}

static void w_on_closing(struct link *l) {
  struct world *w = l->user;
  w->closings++;
  w->body_at_closing = l->body != NULL;
}

static void w_on_close(struct link *l) {
  struct world *w = l->user;
  w->closes++;
}

/* A link on fd (non-blocking) with the test's callbacks; far is the test's end. */
static void w_start_on(struct world *w, int fd, int far, bool fds) {
  memset(w, 0, sizeof *w);
  ck_assert_int_eq(uv_loop_init(&w->loop), 0);
  w->ops = (struct link_ops){.kind = "testers",
                             .sends_fds = fds,
                             .takes_fds = fds,
                             .limits = w_limits,
                             .describe = w_describe,
                             .on_frame = w_on_frame,
                             .on_closing = w_on_closing,
                             .on_close = w_on_close};
  w->lim = (struct link_limits){.max_body = DEP_PROTO_MAX_BODY,
                                .queue_bytes = 1u << 20,
                                .queue_key = "test.queue_bytes"};
  w->far = far;
  /* The link's log lines go to a file the test reads back (each test is its own process). */
  char path[] = "/tmp/check_link.XXXXXX";
  w->log_fd = mkstemp(path);
  ck_assert_int_ge(w->log_fd, 0);
  unlink(path);
  dup2(w->log_fd, STDERR_FILENO);
  ck_assert_int_eq(fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK), 0);
  ck_assert_int_eq(link_init(&w->link, &w->loop, fd, &w->ops, w), 0);
}

static void w_start(struct world *w, bool fds) {
  int sv[2];
  ck_assert_int_eq(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  w_start_on(w, sv[0], sv[1], fds);
}

/* Let the loop handle what is there (and run close callbacks). */
static void w_spin(struct world *w) {
  for (int i = 0; i < 8; i++)
    uv_run(&w->loop, UV_RUN_NOWAIT);
}

/* Whether the link logged a line containing text. */
static bool w_logged(struct world *w, const char *text) {
  ssize_t n = pread(w->log_fd, w->log, sizeof w->log - 1, 0);
  w->log[n > 0 ? n : 0] = '\0';
  return strstr(w->log, text) != NULL;
}

static void w_stop(struct world *w) {
  link_close(&w->link, "the test is over");
  w_spin(w);
  ck_assert_int_eq(w->closes, 1);
  ck_assert_int_eq(uv_loop_close(&w->loop), 0);
  close(w->far);
  close(w->log_fd);
}

static void send_all(int fd, const void *p, size_t len) {
  const uint8_t *b = p;
  while (len > 0) {
    ssize_t n = send(fd, b, len, MSG_NOSIGNAL);
    ck_assert_int_gt(n, 0);
    b += n;
    len -= (size_t)n;
  }
}

static void recv_all(int fd, void *p, size_t len) {
  ck_assert_int_eq(recv(fd, p, len, MSG_WAITALL), (ssize_t)len);
}

/* Read one frame from the test's end; returns its header, the body into body[cap]. */
static struct dep_frame_hdr read_frame(int fd, uint8_t *body, size_t cap) {
  uint8_t raw[DEP_PROTO_HDR_LEN];
  recv_all(fd, raw, sizeof raw);
  struct dep_frame_hdr h;
  ck_assert_int_eq(proto_hdr_decode(raw, DEP_PROTO_MAX_BODY, &h, NULL, 0), 0);
  ck_assert_uint_le(h.body_len, cap);
  if (h.body_len > 0)
    recv_all(fd, body, h.body_len);
  return h;
}

/* The test's end reads an ERROR frame with this code, then end of file. */
static void expect_error_then_eof(int fd, int code, const char *text) {
  uint8_t body[DEP_PROTO_MAX_BODY];
  struct dep_frame_hdr h = read_frame(fd, body, sizeof body);
  ck_assert_uint_eq(h.type, DEP_MSG_ERROR);
  struct dep_msg_error e;
  ck_assert_int_eq(proto_decode_error(body, h.body_len, &e), 0);
  ck_assert_int_eq(e.code, code);
  ck_assert_msg(strstr(e.message, text) != NULL, "\"%s\" lacks \"%s\"", e.message, text);
  uint8_t byte;
  ck_assert_int_eq(recv(fd, &byte, 1, 0), 0);
}

static void encode(struct proto_buf *b, uint16_t type, uint32_t id, const void *msg) {
  ck_assert_int_eq(proto_frame_encode(b, type, 0, id, msg), 0);
}

START_TEST(frames_split_at_every_byte_boundary_arrive_whole) {
  struct world w;
  w_start(&w, false);
  struct dep_msg_hello hello = {.version = DEP_PROTO_VERSION, .pid = 42};
  snprintf(hello.name, sizeof hello.name, "split");
  struct proto_buf b;
  proto_buf_init(&b);
  encode(&b, DEP_MSG_HELLO, 7, &hello);
  size_t first = b.len;
  encode(&b, DEP_MSG_STATUS, 8, NULL); /* no body: the header alone is the frame */
  int want = 0;
  for (size_t cut = 1; cut < b.len; cut++) {
    w.frames = 0;
    send_all(w.far, b.data, cut);
    w_spin(&w);
    ck_assert_int_eq(w.frames, cut >= first ? 1 : 0);
    send_all(w.far, b.data + cut, b.len - cut);
    w_spin(&w);
    ck_assert_int_eq(w.frames, 2);
    ck_assert_uint_eq(w.hdr[0].type, DEP_MSG_HELLO);
    ck_assert_uint_eq(w.hdr[0].request_id, 7);
    ck_assert_uint_eq(w.len[0], first - DEP_PROTO_HDR_LEN);
    ck_assert_mem_eq(w.body[0], b.data + DEP_PROTO_HDR_LEN, w.len[0]);
    struct dep_msg_hello got;
    ck_assert_int_eq(proto_decode_hello(w.body[0], w.len[0], &got), 0);
    ck_assert_str_eq(got.name, "split");
    ck_assert_uint_eq(w.hdr[1].type, DEP_MSG_STATUS);
    ck_assert_uint_eq(w.hdr[1].request_id, 8);
    ck_assert_uint_eq(w.len[1], 0);
    want++;
  }
  /* And one byte at a time. */
  w.frames = 0;
  for (size_t i = 0; i < b.len; i++) {
    send_all(w.far, b.data + i, 1);
    w_spin(&w);
    ck_assert_int_eq(w.frames, i + 1 >= b.len ? 2 : i + 1 >= first ? 1 : 0);
  }
  ck_assert_int_gt(want, 0);
  ck_assert_int_eq(w.closings, 0);
  proto_buf_free(&b);
  w_stop(&w);
}
END_TEST

START_TEST(a_header_over_the_body_limit_is_refused_before_allocating) {
  uint32_t sizes[] = {65, 1u << 20, UINT32_MAX};
  for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
    struct world w;
    w_start(&w, false);
    w.lim.max_body = 64; /* read when the header is checked, not at link_init */
    struct dep_frame_hdr h = {.magic = DEP_PROTO_MAGIC, .version = DEP_PROTO_VERSION,
                              .type = DEP_MSG_HELLO, .request_id = 9, .body_len = sizes[i]};
    uint8_t raw[DEP_PROTO_HDR_LEN];
    proto_hdr_encode(&h, raw);
    send_all(w.far, raw, sizeof raw); /* the header only: no body ever comes */
    w_spin(&w);
    ck_assert_int_eq(w.frames, 0);
    ck_assert_int_eq(w.closings, 1);
    ck_assert_msg(!w.body_at_closing, "a body was allocated for a %u-byte frame", sizes[i]);
    ck_assert_int_eq(w.closes, 1);
    expect_error_then_eof(w.far, DEP_ERR_PROTOCOL, "");
    ck_assert(w_logged(&w, "test link: dropped: "));
    ck_assert_int_eq(uv_loop_close(&w.loop), 0);
    close(w.far);
    close(w.log_fd);
  }
  /* At the limit is fine. */
  struct world w;
  w_start(&w, false);
  w.lim.max_body = 64;
  uint8_t frame[DEP_PROTO_HDR_LEN + 64] = {0};
  struct dep_frame_hdr h = {.magic = DEP_PROTO_MAGIC, .version = DEP_PROTO_VERSION,
                            .type = DEP_MSG_HELLO, .request_id = 10, .body_len = 64};
  proto_hdr_encode(&h, frame);
  send_all(w.far, frame, sizeof frame);
  w_spin(&w);
  ck_assert_int_eq(w.frames, 1);
  ck_assert_uint_eq(w.len[0], 64);
  ck_assert_int_eq(w.closings, 0);
  w_stop(&w);
}
END_TEST

/* A type this build does not know is no framing fault: the frame reaches
 * its owner whole (to answer or ignore), and the next one is read in step. */
START_TEST(a_frame_of_an_unknown_type_reaches_the_owner_whole) {
  struct world w;
  w_start(&w, false);
  uint8_t frame[DEP_PROTO_HDR_LEN + 5] = {0};
  struct dep_frame_hdr h = {.magic = DEP_PROTO_MAGIC, .version = DEP_PROTO_VERSION,
                            .type = DEP_MSG_TYPE_MAX_ + 5, .request_id = 12, .body_len = 5};
  proto_hdr_encode(&h, frame);
  memcpy(frame + DEP_PROTO_HDR_LEN, "abcde", 5);
  send_all(w.far, frame, sizeof frame);
  struct proto_buf b;
  proto_buf_init(&b);
  encode(&b, DEP_MSG_STATUS, 13, NULL);
  send_all(w.far, b.data, b.len);
  proto_buf_free(&b);
  w_spin(&w);
  ck_assert_int_eq(w.frames, 2);
  ck_assert_uint_eq(w.hdr[0].type, DEP_MSG_TYPE_MAX_ + 5);
  ck_assert_uint_eq(w.hdr[0].request_id, 12);
  ck_assert_uint_eq(w.len[0], 5);
  ck_assert(memcmp(w.body[0], "abcde", 5) == 0);
  ck_assert_uint_eq(w.hdr[1].type, DEP_MSG_STATUS);
  ck_assert_uint_eq(w.hdr[1].request_id, 13);
  ck_assert_int_eq(w.closings, 0);
  w_stop(&w);
}
END_TEST

/* A frame of a version outside the window is refused with an ERROR naming
 * the window, under that version where the owner asks (its clients read
 * it so), under this build's otherwise; the link goes either way. */
START_TEST(a_frame_of_another_version_is_refused_in_the_owners_way) {
  for (int theirs = 0; theirs < 2; theirs++) {
    struct world w;
    w_start(&w, false);
    w.ops.refuses_in_their_version = theirs;
    uint16_t v = DEP_PROTO_VERSION + 2;
    struct dep_frame_hdr h = {.magic = DEP_PROTO_MAGIC, .version = v, .type = DEP_MSG_STATUS,
                              .request_id = 21};
    uint8_t raw[DEP_PROTO_HDR_LEN];
    proto_hdr_encode(&h, raw);
    send_all(w.far, raw, sizeof raw);
    w_spin(&w);
    ck_assert_int_eq(w.frames, 0);
    ck_assert_int_eq(w.closes, 1);
    recv_all(w.far, raw, sizeof raw);
    struct dep_frame_hdr got;
    int rc = proto_hdr_decode(raw, DEP_PROTO_MAX_BODY, &got, NULL, 0);
    ck_assert_int_eq(rc, theirs ? DEP_ERR_VERSION : 0);
    ck_assert_uint_eq(got.version, theirs ? v : DEP_PROTO_VERSION);
    ck_assert_uint_eq(got.type, DEP_MSG_ERROR);
    ck_assert_uint_eq(got.request_id, 21);
    uint8_t body[DEP_MSG_TEXT_MAX + 8];
    ck_assert_uint_le(got.body_len, sizeof body);
    recv_all(w.far, body, got.body_len);
    struct dep_msg_error e;
    ck_assert_int_eq(proto_decode_error(body, got.body_len, &e), 0);
    ck_assert_int_eq(e.code, DEP_ERR_VERSION);
    char want[96];
    snprintf(want, sizeof want, "speaks protocol versions %d..%d; your frame is of version %u",
             DEP_PROTO_MIN_VERSION, DEP_PROTO_VERSION, (unsigned)v);
    ck_assert_msg(strstr(e.message, want) != NULL, "\"%s\" lacks \"%s\"", e.message, want);
    ck_assert(strstr(e.message, "upgrade this deepepd") != NULL);
    ck_assert_int_eq(uv_loop_close(&w.loop), 0);
    close(w.far);
    close(w.log_fd);
  }
}
END_TEST

/* Send a STATUS header with fd riding on it (flagged or not) from the test's end. */
static void send_header_with_fd(int sock, int fd, bool flagged) {
  struct dep_frame_hdr h = {.magic = DEP_PROTO_MAGIC, .version = DEP_PROTO_VERSION,
                            .type = DEP_MSG_STATUS, .flags = flagged ? DEP_FRAME_F_FDS : 0,
                            .request_id = 3};
  uint8_t raw[DEP_PROTO_HDR_LEN];
  proto_hdr_encode(&h, raw);
  ck_assert_int_eq(fdpass_send(sock, raw, sizeof raw, &fd, fd >= 0 ? 1 : 0), (ssize_t)sizeof raw);
}

START_TEST(fds_sent_to_a_link_that_takes_none_drop_it_and_are_closed) {
  struct world w;
  w_start(&w, false);
  int before = dw_open_fds();
  int passed = open("/dev/null", O_RDONLY | O_CLOEXEC);
  send_header_with_fd(w.far, passed, true);
  close(passed);
  w_spin(&w);
  ck_assert_int_eq(w.frames, 0);
  ck_assert_int_eq(w.closings, 1);
  ck_assert_int_eq(w.closes, 1);
  ck_assert(w_logged(&w, "test link: dropped: sent 1 file descriptor(s); testers never send any"));
  /* The fd that came and the link's socket are both closed. */
  ck_assert_int_eq(dw_open_fds(), before - 1);
  uint8_t byte;
  ck_assert_int_eq(recv(w.far, &byte, 1, 0), 0);
  ck_assert_int_eq(uv_loop_close(&w.loop), 0);
  close(w.far);
  close(w.log_fd);

  /* A frame that only claims to carry fds is refused with an ERROR. */
  w_start(&w, false);
  send_header_with_fd(w.far, -1, true);
  w_spin(&w);
  ck_assert_int_eq(w.frames, 0);
  ck_assert_int_eq(w.closes, 1);
  expect_error_then_eof(w.far, DEP_ERR_PROTOCOL, "testers never send any");
  ck_assert_int_eq(uv_loop_close(&w.loop), 0);
  close(w.far);
  close(w.log_fd);

  /* And a link that takes none may not send any either. */
  w_start(&w, false);
  int fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  ck_assert_int_eq(link_send(&w.link, DEP_MSG_STATUS, 1, NULL, &fd, 1), DEP_ERR_INVALID);
  close(fd);
  ck_assert_int_eq(w.closings, 0);
  w_stop(&w);
}
END_TEST

START_TEST(fds_ride_both_ways_on_a_link_that_passes_them) {
  struct world w;
  w_start(&w, true);
  int before = dw_open_fds();
  int passed = open("/dev/null", O_RDONLY | O_CLOEXEC);
  struct stat want;
  ck_assert_int_eq(fstat(passed, &want), 0);
  send_header_with_fd(w.far, passed, true);
  w_spin(&w);
  ck_assert_int_eq(w.frames, 1);
  ck_assert_int_eq(w.nfds, 1);
  ck_assert(w.fd_st.st_ino == want.st_ino && w.fd_st.st_dev == want.st_dev);
  ck_assert_int_eq(dw_open_fds(), before + 1); /* ours only: the link closed what it was not kept */

  /* The link sends one back with a frame; the caller keeps its own copy. */
  ck_assert_int_eq(link_send(&w.link, DEP_MSG_STATUS, 4, NULL, &passed, 1), 0);
  uint8_t raw[DEP_PROTO_HDR_LEN];
  int got[DEP_PROTO_MAX_FDS];
  int ngot = 0;
  ck_assert_int_eq(fdpass_recv(w.far, raw, sizeof raw, got, DEP_PROTO_MAX_FDS, &ngot),
                   (ssize_t)sizeof raw);
  ck_assert_int_eq(ngot, 1);
  struct dep_frame_hdr h;
  ck_assert_int_eq(proto_hdr_decode(raw, DEP_PROTO_MAX_BODY, &h, NULL, 0), 0);
  ck_assert_uint_eq(h.flags & DEP_FRAME_F_FDS, DEP_FRAME_F_FDS);
  fdpass_close_all(got, ngot);
  close(passed);

  /* fds with a frame that does not say so are refused. */
  passed = open("/dev/null", O_RDONLY | O_CLOEXEC);
  send_header_with_fd(w.far, passed, false);
  close(passed);
  w_spin(&w);
  ck_assert_int_eq(w.frames, 1);
  ck_assert_int_eq(w.closes, 1);
  expect_error_then_eof(w.far, DEP_ERR_PROTOCOL, "does not carry any");
  ck_assert_int_eq(dw_open_fds(), before - 1);
  ck_assert_int_eq(uv_loop_close(&w.loop), 0);
  close(w.far);
  close(w.log_fd);
}
END_TEST

START_TEST(the_output_bound_closes_a_link_that_does_not_read) {
  struct world w;
  w_start(&w, false);
  int small = 4096;
  setsockopt(w.link.fd, SOL_SOCKET, SO_SNDBUF, &small, sizeof small);
  w.lim.queue_bytes = 64u << 10; /* lowered after init, as a reload would */
  struct dep_msg_error e = {.code = DEP_ERR_STATE};
  memset(e.message, 'x', sizeof e.message - 1);
  int rc = 0, sent = 0;
  for (; sent < 100000 && rc == 0; sent++) {
    rc = link_send(&w.link, DEP_MSG_ERROR, (uint32_t)sent, &e, NULL, 0);
    ck_assert_uint_le(w.link.out_bytes, w.lim.queue_bytes);
  }
  ck_assert_int_eq(rc, DEP_ERR_LIMIT);
  ck_assert_int_eq(w.closings, 1);
  ck_assert(w_logged(&w, "test link: dropped: does not read its replies: its output queue would "
                         "pass 65536 bytes (test.queue_bytes)"));
  ck_assert_int_eq(link_send(&w.link, DEP_MSG_STATUS, 1, NULL, NULL, 0), DEP_ERR_DAEMON_GONE);
  w_spin(&w);
  ck_assert_int_eq(w.closes, 1);
  ck_assert_int_eq(uv_loop_close(&w.loop), 0);
  close(w.far);
  close(w.log_fd);
}
END_TEST

START_TEST(close_is_deferred_and_on_close_runs_once) {
  struct world w;
  w_start(&w, false);
  w.close_in_frame = true;
  /* Three frames in one write: the first closes the link, the others are never handled. */
  struct proto_buf b;
  proto_buf_init(&b);
  for (uint32_t i = 0; i < 3; i++)
    encode(&b, DEP_MSG_STATUS, i, NULL);
  send_all(w.far, b.data, b.len);
  proto_buf_free(&b);
  uv_run(&w.loop, UV_RUN_NOWAIT);
  ck_assert_int_eq(w.frames, 1);
  ck_assert_int_eq(w.closings, 1);
  w_spin(&w);
  w_spin(&w);
  ck_assert_int_eq(w.frames, 1);
  ck_assert_int_eq(w.closings, 1);
  ck_assert_int_eq(w.closes, 1);
  link_close(&w.link, "after the callback: nothing happens");
  w_spin(&w);
  ck_assert_int_eq(w.closes, 1);
  ck_assert_int_eq(uv_loop_close(&w.loop), 0);
  close(w.far);
  close(w.log_fd);

  /* The far end going: closed once, quietly. */
  w_start(&w, false);
  close(w.far);
  w_spin(&w);
  ck_assert_int_eq(w.closings, 1);
  ck_assert_int_eq(w.closes, 1);
  ck_assert(!w_logged(&w, "dropped"));
  ck_assert_int_eq(uv_loop_close(&w.loop), 0);
  close(w.log_fd);

  /* Finishing: what is queued goes out first, then the link closes. */
  w_start(&w, false);
  ck_assert_int_eq(link_send(&w.link, DEP_MSG_SHUTDOWN, 0, NULL, NULL, 0), 0);
  link_finish(&w.link);
  ck_assert(!link_open(&w.link));
  w_spin(&w);
  ck_assert_int_eq(w.closes, 1);
  uint8_t body[64];
  ck_assert_uint_eq(read_frame(w.far, body, sizeof body).type, DEP_MSG_SHUTDOWN);
  uint8_t byte;
  ck_assert_int_eq(recv(w.far, &byte, 1, 0), 0);
  ck_assert_int_eq(uv_loop_close(&w.loop), 0);
  close(w.far);
  close(w.log_fd);
}
END_TEST

START_TEST(a_link_over_tcp_carries_frames_both_ways) {
  int lsn = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ck_assert_int_ge(lsn, 0);
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t slen = sizeof sa;
  ck_assert_int_eq(bind(lsn, (struct sockaddr *)&sa, sizeof sa), 0);
  ck_assert_int_eq(listen(lsn, 1), 0);
  ck_assert_int_eq(getsockname(lsn, (struct sockaddr *)&sa, &slen), 0);
  int far = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ck_assert_int_eq(connect(far, (struct sockaddr *)&sa, sizeof sa), 0);
  int fd = accept4(lsn, NULL, NULL, SOCK_CLOEXEC);
  ck_assert_int_ge(fd, 0);
  close(lsn);

  struct world w;
  w_start_on(&w, fd, far, false);
  struct dep_msg_hello hello = {.version = DEP_PROTO_VERSION, .pid = 1};
  snprintf(hello.name, sizeof hello.name, "over tcp");
  struct proto_buf b;
  proto_buf_init(&b);
  encode(&b, DEP_MSG_HELLO, 11, &hello);
  send_all(far, b.data, 5); /* split, as TCP may */
  w_spin(&w);
  send_all(far, b.data + 5, b.len - 5);
  for (int i = 0; i < 100 && w.frames == 0; i++) {
    w_spin(&w);
    usleep(1000);
  }
  ck_assert_int_eq(w.frames, 1);
  ck_assert_uint_eq(w.hdr[0].request_id, 11);
  proto_buf_free(&b);

  struct dep_msg_text t;
  snprintf(t.text, sizeof t.text, "hello back");
  ck_assert_int_eq(link_send(&w.link, DEP_MSG_DRAIN_OK, 11, &t, NULL, 0), 0);
  uint8_t body[DEP_PROTO_MAX_BODY];
  struct dep_frame_hdr h = read_frame(far, body, sizeof body);
  ck_assert_uint_eq(h.type, DEP_MSG_DRAIN_OK);
  ck_assert_uint_eq(h.request_id, 11);
  ck_assert_int_eq(w.closings, 0);
  w_stop(&w);
}
END_TEST

Suite *link_suite(void);
Suite *link_suite(void) {
  Suite *s = suite_create("link");
  TCase *tc = tcase_create("framing");
  tcase_add_test(tc, frames_split_at_every_byte_boundary_arrive_whole);
  tcase_add_test(tc, a_header_over_the_body_limit_is_refused_before_allocating);
  tcase_add_test(tc, a_frame_of_an_unknown_type_reaches_the_owner_whole);
  tcase_add_test(tc, a_frame_of_another_version_is_refused_in_the_owners_way);
  tcase_add_test(tc, fds_sent_to_a_link_that_takes_none_drop_it_and_are_closed);
  tcase_add_test(tc, fds_ride_both_ways_on_a_link_that_passes_them);
  tcase_add_test(tc, the_output_bound_closes_a_link_that_does_not_read);
  tcase_add_test(tc, close_is_deferred_and_on_close_runs_once);
  tcase_add_test(tc, a_link_over_tcp_carries_frames_both_ways);
  suite_add_tcase(s, tc);
  return s;
}
