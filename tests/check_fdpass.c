/*
 * check_fdpass.c — file descriptors across a unix socket (proto/fdpass.c,
 * fdpass.h) as a specification: they arrive close-on-exec and refer to the
 * files sent; more than the receiver has room for, or ancillary data other
 * than fds, is refused with nothing left open; EOF, an empty non-blocking
 * read and a dead peer each have their code.
 */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include "daemonwire.h"
#include "deepep.h"
#include "fdpass.h"

static void make_memfds(int *fds, int n) {
  for (int i = 0; i < n; i++) {
    fds[i] = memfd_create("check_proto", 0);
    ck_assert_int_ge(fds[i], 0);
  }
}

START_TEST(fds_cross_a_socket_and_refer_to_the_same_files) {
  int sv[2], mine[3], got[4] = {-1, -1, -1, -1}, ngot = 0;
  ck_assert_int_eq(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  make_memfds(mine, 3);
  ck_assert_int_eq(fdpass_send(sv[0], "frame", 5, mine, 3), 5);
  char buf[16] = "";
  ck_assert_int_eq(fdpass_recv(sv[1], buf, sizeof buf, got, 4, &ngot), 5);
  ck_assert_mem_eq(buf, "frame", 5);
  ck_assert_int_eq(ngot, 3);
  for (int i = 0; i < 3; i++) {
    ck_assert_int_ne(got[i], mine[i]);
    ck_assert_int_ne(fcntl(got[i], F_GETFD) & FD_CLOEXEC, 0);
    char msg[16], back[16] = "";
    int len = snprintf(msg, sizeof msg, "file %d", i);
    ck_assert_int_eq(pwrite(got[i], msg, (size_t)len, 0), len);
    ck_assert_int_eq(pread(mine[i], back, sizeof back, 0), len);
    ck_assert_mem_eq(back, msg, (size_t)len);
  }
  ck_assert_int_eq(got[3], -1);
  fdpass_close_all(got, 3);
  ck_assert_int_eq(got[0], -1);
  ck_assert_int_eq(fcntl(mine[0], F_GETFD), 0); /* sending kept our copies open */
  fdpass_close_all(mine, 3);

  /* Plain bytes, EOF, a non-blocking empty read and a dead peer. */
  ck_assert_int_eq(fdpass_send(sv[0], "xy", 2, NULL, 0), 2);
  ngot = 0;
  ck_assert_int_eq(fdpass_recv(sv[1], buf, sizeof buf, NULL, 0, &ngot), 2);
  ck_assert_int_eq(fcntl(sv[1], F_SETFL, O_NONBLOCK), 0);
  errno = 0;
  ck_assert_int_eq(fdpass_recv(sv[1], buf, sizeof buf, NULL, 0, &ngot), DEP_ERR_IO);
  ck_assert_int_eq(errno, EAGAIN);
  close(sv[0]);
  ck_assert_int_eq(fdpass_recv(sv[1], buf, sizeof buf, NULL, 0, &ngot), 0);
  ck_assert_int_eq(fdpass_send(sv[1], "z", 1, NULL, 0), DEP_ERR_DAEMON_GONE);
  ck_assert_int_eq(fdpass_send(sv[1], "", 0, mine, 1), DEP_ERR_INVALID);
  close(sv[1]);
}
END_TEST

START_TEST(more_fds_than_room_is_refused_and_nothing_leaks) {
  /* {fds sent, room}: 3 into 1 truncates the control data (MSG_CTRUNC);
   * 2 into 1 fits the kernel's rounded-up buffer and must still be refused. */
  const int cases[][2] = {{3, 0}, {3, 1}, {3, 2}, {2, 1}, {1, 0}};
  for (size_t r = 0; r < sizeof cases / sizeof cases[0]; r++) {
    int sv[2], mine[3], got[3] = {-1, -1, -1}, ngot = 0, nsend = cases[r][0];
    ck_assert_int_eq(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
    int before = dw_open_fds();
    make_memfds(mine, nsend);
    ck_assert_int_eq(fdpass_send(sv[0], "f", 1, mine, nsend), 1);
    fdpass_close_all(mine, nsend);
    char c;
    ck_assert_int_eq(fdpass_recv(sv[1], &c, 1, got, cases[r][1], &ngot), DEP_ERR_PROTOCOL);
    ck_assert_int_eq(ngot, 0);
    ck_assert_int_eq(got[0], -1);
    ck_assert_int_eq(dw_open_fds(), before);
    close(sv[0]);
    close(sv[1]);
  }
}
END_TEST

START_TEST(ancillary_data_other_than_fds_is_refused_and_nothing_leaks) {
  int sv[2], mine[1], got[64], ngot = 0, on = 1;
  ck_assert_int_eq(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  /* With SO_PASSCRED the kernel adds SCM_CREDENTIALS to every message. */
  ck_assert_int_eq(setsockopt(sv[1], SOL_SOCKET, SO_PASSCRED, &on, sizeof on), 0);
  int before = dw_open_fds();
  make_memfds(mine, 1);
  ck_assert_int_eq(fdpass_send(sv[0], "f", 1, mine, 1), 1);
  fdpass_close_all(mine, 1);
  char c;
  /* Room for 64 fds: both messages fit, so only the type check refuses it. */
  ck_assert_int_eq(fdpass_recv(sv[1], &c, 1, got, 64, &ngot), DEP_ERR_PROTOCOL);
  ck_assert_int_eq(ngot, 0);
  ck_assert_int_eq(dw_open_fds(), before);
  close(sv[0]);
  close(sv[1]);
}
END_TEST

Suite *fdpass_suite(void);
Suite *fdpass_suite(void) {
  Suite *s = suite_create("fdpass");
  TCase *fd = tcase_create("fdpass");
  tcase_add_test(fd, fds_cross_a_socket_and_refer_to_the_same_files);
  tcase_add_test(fd, more_fds_than_room_is_refused_and_nothing_leaks);
  tcase_add_test(fd, ancillary_data_other_than_fds_is_refused_and_nothing_leaks);
  suite_add_tcase(s, fd);
  return s;
}
