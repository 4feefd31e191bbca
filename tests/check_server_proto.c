/*
 * check_server_proto.c — suite server_proto: how deepepd answers what it
 * cannot read, as a whole process (DESIGN §8): a request type it does not
 * know is answered DEP_ERR_UNSUPPORTED and the connection stays, a
 * malformed frame of an unknown type closes it, each type a client may
 * send is checked as before, and frames and HELLOs of protocol versions
 * outside its window are refused naming both versions.  The socket and
 * admission are check_server.c's.
 */
#include <check.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "daemonwire.h"
#include "deepep.h"
#include "proto.h"
#include "testutil.h"

/* Send a frame by hand: a header of this version and type, then len bytes of body. */
static void send_raw_frame(int fd, uint16_t version, uint16_t type, uint32_t req,
                           const uint8_t *body, uint32_t len) {
  uint8_t hdr[DEP_PROTO_HDR_LEN];
  struct dep_frame_hdr h = {.magic = DEP_PROTO_MAGIC, .version = version, .type = type,
                            .request_id = req, .body_len = len};
  proto_hdr_encode(&h, hdr);
  ck_assert_int_eq(dw_send_all(fd, hdr, sizeof hdr), 0);
  if (len > 0)
    ck_assert_int_eq(dw_send_all(fd, body, len), 0);
}

/* Read an ERROR frame whatever version its header says (an answer to a
 * frame of another version carries that version); its header in *h. */
static void recv_any_version_error(int fd, struct dep_frame_hdr *h, struct dep_msg_error *e) {
  uint8_t hdr[DEP_PROTO_HDR_LEN];
  struct pollfd p = {.fd = fd, .events = POLLIN};
  /* 5 s: a ceiling for a reply the daemon sends at once, on a loaded machine. */
  ck_assert_msg(poll(&p, 1, 5000) == 1, "no reply within 5 s");
  ck_assert_int_eq(recv(fd, hdr, sizeof hdr, MSG_WAITALL), (ssize_t)sizeof hdr);
  int rc = proto_hdr_decode(hdr, DEP_PROTO_MAX_BODY, h, NULL, 0);
  ck_assert_msg(rc == 0 || rc == DEP_ERR_VERSION, "bad header (%s)", dep_errname(rc));
  ck_assert_uint_eq(h->type, DEP_MSG_ERROR);
  uint8_t *body = malloc(h->body_len + 1);
  ck_assert_ptr_nonnull(body);
  ck_assert_int_eq(recv(fd, body, h->body_len, MSG_WAITALL), (ssize_t)h->body_len);
  ck_assert_int_eq(proto_decode_error(body, h->body_len, e), 0);
  free(body);
}

static void assert_says(const char *msg, const char *want) {
  ck_assert_msg(strstr(msg, want) != NULL, "\"%s\" does not say \"%s\"", msg, want);
}

/* DESIGN §8: a request type the daemon does not know gets UNSUPPORTED and
 * the connection stays, so a newer library can try a new request. */
START_TEST(test_an_unknown_request_type_is_answered_and_the_connection_stays) {
  struct tu_daemon d;
  dw_start(&d, NULL);
  int fd = dw_client(&d);
  const uint8_t body[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11};
  uint16_t type = DEP_MSG_TYPE_MAX_ + 5;
  send_raw_frame(fd, DEP_PROTO_VERSION, type, 77, body, sizeof body);
  struct dw_frame *f = dw_frame_new();
  ck_assert_int_eq(dw_recv_frame(fd, f, 5000), 0);
  ck_assert_str_eq(proto_type_name(f->h.type), "ERROR");
  ck_assert_uint_eq(f->h.request_id, 77);
  struct dep_msg_error e;
  ck_assert_int_eq(proto_decode_error(f->body, f->h.body_len, &e), 0);
  ck_assert_str_eq(dep_errname(e.code), dep_errname(DEP_ERR_UNSUPPORTED));
  char want[96];
  dw_sfmt(want, sizeof want, "does not know request type %u", (unsigned)type);
  assert_says(e.message, want);
  dw_sfmt(want, sizeof want, "protocol %d, version %s", DEP_PROTO_VERSION, DEP_VERSION_STRING);
  assert_says(e.message, want);
  /* The body was skipped whole: the next request on the connection is read right. */
  struct dep_status *st = dw_status(fd);
  dep_status_free(st);
  /* An empty body too. */
  send_raw_frame(fd, DEP_PROTO_VERSION, 0xFFFF, 78, NULL, 0);
  dw_expect_error(fd, DEP_ERR_UNSUPPORTED, NULL, 0);
  st = dw_status(fd);
  dep_status_free(st);
  free(f);
  close(fd);
  dw_stop_ok(&d);
}
END_TEST

/* What is malformed still closes the connection, an unknown type or not. */
START_TEST(test_a_malformed_frame_of_an_unknown_type_closes_the_connection) {
  struct tu_daemon d;
  dw_start(&d, NULL);
  /* Over the size limit: it cannot be skipped. */
  int fd = dw_client(&d);
  send_raw_frame(fd, DEP_PROTO_VERSION, DEP_MSG_TYPE_MAX_ + 5, 3, NULL, 0);
  dw_expect_error(fd, DEP_ERR_UNSUPPORTED, NULL, 0);
  uint8_t hdr[DEP_PROTO_HDR_LEN];
  struct dep_frame_hdr h = {.magic = DEP_PROTO_MAGIC, .version = DEP_PROTO_VERSION,
                            .type = DEP_MSG_TYPE_MAX_ + 5, .request_id = 4,
                            .body_len = DEP_PROTO_MAX_BODY + 1};
  proto_hdr_encode(&h, hdr);
  ck_assert_int_eq(dw_send_all(fd, hdr, sizeof hdr), 0);
  char msg[DEP_MSG_TEXT_MAX];
  dw_expect_error(fd, DEP_ERR_PROTOCOL, msg, sizeof msg);
  assert_says(msg, "exceeds the limit");
  dw_expect_eof(fd);
  close(fd);
  /* A bad magic. */
  fd = dw_client(&d);
  h.body_len = 0;
  proto_hdr_encode(&h, hdr);
  hdr[0] ^= 0xFF;
  ck_assert_int_eq(dw_send_all(fd, hdr, sizeof hdr), 0);
  dw_expect_error(fd, DEP_ERR_PROTOCOL, msg, sizeof msg);
  assert_says(msg, "magic");
  dw_expect_eof(fd);
  close(fd);
  /* Before HELLO an unknown type is the wrong first message, as any other is. */
  fd = tu_connect_raw(d.sock);
  send_raw_frame(fd, DEP_PROTO_VERSION, DEP_MSG_TYPE_MAX_ + 5, 5, NULL, 0);
  dw_expect_error(fd, DEP_ERR_STATE, NULL, 0);
  dw_expect_eof(fd);
  close(fd);
  dw_stop_ok(&d);
}
END_TEST

/* Every known type, as a client's frame on a greeted connection: a reply or
 * a daemon's message is refused, a request's body is checked before
 * anything else (an empty one must be empty, any other must decode), each
 * with its own words and the connection closed.  The classes are written
 * out here, apart from proto.h's DEP_MSG_MAP, so that the table cannot
 * change what the daemon does unnoticed. */
START_TEST(test_each_type_from_a_client_is_checked_as_it_always_was) {
  static const char *const empty_requests[] = {"STATUS", "DETACH", "RELOAD", "PEERS",
                                               "JOB_NODES", "STATS_LEND", "CLIENTS",
                                               "XRING_LEND", "JOB_EVENTS"};
  static const char *const body_requests[] = {"HELLO", "ATTACH", "DRAIN", "STATS", "KERNELS",
                                              "TUNE"};
  struct tu_daemon d;
  dw_start(&d, NULL);
  int requests = 0;
  for (uint16_t t = 1; t < DEP_MSG_TYPE_MAX_; t++) {
    const char *name = proto_type_name(t);
    bool empty = false, body = false;
    for (size_t i = 0; i < sizeof empty_requests / sizeof *empty_requests; i++)
      empty |= strcmp(name, empty_requests[i]) == 0;
    for (size_t i = 0; i < sizeof body_requests / sizeof *body_requests; i++)
      body |= strcmp(name, body_requests[i]) == 0;
    /* Three bytes: a body where none belongs, and too short for any request's. */
    const uint8_t junk[3] = {0, 0, 0};
    int fd = dw_client(&d);
    send_raw_frame(fd, DEP_PROTO_VERSION, t, 40 + t, junk, empty || body ? sizeof junk : 0);
    char msg[DEP_MSG_TEXT_MAX], want[96];
    dw_expect_error(fd, DEP_ERR_PROTOCOL, msg, sizeof msg);
    if (empty)
      dw_sfmt(want, sizeof want, "%s carries no body, got 3 bytes", name);
    else if (body)
      dw_sfmt(want, sizeof want, "malformed %s body (3 bytes)", name);
    else
      dw_sfmt(want, sizeof want, "clients may not send %s frames", name);
    assert_says(msg, want);
    dw_expect_eof(fd);
    close(fd);
    requests += empty || body;
  }
  ck_assert_int_eq(requests, 15); /* every request above is a known type */
  dw_stop_ok(&d);
}
END_TEST

/* A HELLO below or above the window (proto.h) is refused naming the window
 * and the client's version, and the refusal of a frame of another version
 * carries that version in its header, so the far end can read it. */
START_TEST(test_versions_outside_the_window_are_refused_naming_both) {
  struct tu_daemon d;
  dw_start(&d, NULL);
  char window[64];
  dw_sfmt(window, sizeof window, "speaks protocol versions %d..%d", DEP_PROTO_MIN_VERSION,
          DEP_PROTO_VERSION);
  const uint32_t outside[] = {DEP_PROTO_MIN_VERSION - 1, DEP_PROTO_VERSION + 1};
  for (int i = 0; i < 2; i++) {
    uint32_t v = outside[i];
    const char *upgrade = v > DEP_PROTO_VERSION ? "upgrade this deepepd" : "upgrade the older end";
    char msg[DEP_MSG_TEXT_MAX], want[96];
    /* In the HELLO's body, under a header of this version. */
    int fd = tu_connect_raw(d.sock);
    dw_hello_as(fd, v);
    dw_expect_error(fd, DEP_ERR_VERSION, msg, sizeof msg);
    dw_sfmt(want, sizeof want, "speaks version %u;", (unsigned)v);
    assert_says(msg, want);
    assert_says(msg, window);
    assert_says(msg, upgrade);
    dw_expect_eof(fd);
    close(fd);
    /* In the frame header: the whole HELLO of that version. */
    fd = tu_connect_raw(d.sock);
    struct proto_buf b;
    proto_buf_init(&b);
    struct dep_msg_hello hello = {.version = v, .pid = (uint32_t)getpid(), .name = "old"};
    ck_assert_int_eq(proto_frame_encode(&b, DEP_MSG_HELLO, 0, 9, &hello), 0);
    b.data[4] = (uint8_t)v; /* the version field, little-endian */
    b.data[5] = (uint8_t)(v >> 8);
    ck_assert_int_eq(dw_send_all(fd, b.data, b.len), 0);
    proto_buf_free(&b);
    struct dep_frame_hdr h;
    struct dep_msg_error e;
    recv_any_version_error(fd, &h, &e);
    ck_assert_uint_eq(h.version, v);
    ck_assert_uint_eq(h.request_id, 9);
    ck_assert_str_eq(dep_errname(e.code), dep_errname(DEP_ERR_VERSION));
    dw_sfmt(want, sizeof want, "your frame is of version %u", (unsigned)v);
    assert_says(e.message, want);
    assert_says(e.message, window);
    assert_says(e.message, upgrade);
    dw_expect_eof(fd);
    close(fd);
  }
  dw_stop_ok(&d);
}
END_TEST

Suite *server_proto_suite(void);
Suite *server_proto_suite(void) {
  Suite *s = suite_create("server_proto");
  TCase *tc = tcase_create("protocol");
  tcase_set_timeout(tc, 90);
  tcase_add_test(tc, test_an_unknown_request_type_is_answered_and_the_connection_stays);
  tcase_add_test(tc, test_a_malformed_frame_of_an_unknown_type_closes_the_connection);
  tcase_add_test(tc, test_versions_outside_the_window_are_refused_naming_both);
  tcase_add_test(tc, test_each_type_from_a_client_is_checked_as_it_always_was);
  suite_add_tcase(s, tc);
  return s;
}
