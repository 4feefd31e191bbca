/*
 * check_client.c — libdeepep-client as a specification where no real
 * daemon answers: a missing or stale daemon gives an error that says where
 * it looked and how to start one; bad arguments and short structs are
 * refused naming the field; a misbehaving peer (a scripted fake daemon) is
 * refused with the right code and leaks no fd; the shared library exports
 * only dep_* under its SONAME.  Against a real deepepd, and deepepctl:
 * check_client_daemon.c.
 */
#include <check.h>
#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "clienttest.h"
#include "cuda_ops.h"
#include "daemonwire.h"
#include "deepep.h"
#include "fake_daemon.h"
#include "proto.h"
#include "slab.h"
#include "sm_budget.h"
#include "testutil.h"

/* ---- helpers ------------------------------------------------------------- */

static int count_open_fds(void) {
  DIR *d = opendir("/proc/self/fd");
  ck_assert_ptr_nonnull(d);
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL)
    if (e->d_name[0] != '.')
      n++;
  closedir(d);
  return n;
}

/* ---- no daemon -------------------------------------------------------------- */

START_TEST(missing_socket_is_no_daemon_naming_path_and_remedy) {
  char dir[200], sock[256];
  tu_tmpdir(dir, sizeof dir);
  snprintf(sock, sizeof sock, "%s/absent.sock", dir);
  dep_client_t *c = cl_new_client();
  ck_assert_int_eq(dep_connect(c, sock), DEP_ERR_NO_DAEMON);
  ck_assert_ptr_nonnull(strstr(dep_errmsg(c), sock));
  ck_assert_ptr_nonnull(strstr(dep_errmsg(c), "systemctl start deepepd"));
  /* The handle stays usable: the same failure again, no crash. */
  ck_assert_int_eq(dep_status(c, &(struct dep_status *){NULL}), DEP_ERR_STATE);
  dep_client_free(c);
  tu_rmtree(dir);
}
END_TEST

START_TEST(env_socket_is_used_and_named) {
  char dir[200], sock[256];
  tu_tmpdir(dir, sizeof dir);
  snprintf(sock, sizeof sock, "%s/from-env.sock", dir);
  setenv(DEP_SOCKET_ENV, sock, 1);
  dep_client_t *c = cl_new_client();
  ck_assert_int_eq(dep_connect(c, NULL), DEP_ERR_NO_DAEMON);
  ck_assert_ptr_nonnull(strstr(dep_errmsg(c), sock));
  ck_assert_ptr_nonnull(strstr(dep_errmsg(c), DEP_SOCKET_ENV));
  unsetenv(DEP_SOCKET_ENV);
  ck_assert_int_eq(dep_connect(c, NULL), DEP_ERR_NO_DAEMON);
  ck_assert_ptr_nonnull(strstr(dep_errmsg(c), DEP_DEFAULT_SOCKET));
  dep_client_free(c);
  tu_rmtree(dir);
}
END_TEST

START_TEST(stale_socket_is_no_daemon) {
  char dir[200], sock[256];
  tu_tmpdir(dir, sizeof dir);
  snprintf(sock, sizeof sock, "%s/stale.sock", dir);
  close(fake_daemon_bind(sock)); /* the file stays, nobody listens: what a crashed daemon leaves */
  dep_client_t *c = cl_new_client();
  ck_assert_int_eq(dep_connect(c, sock), DEP_ERR_NO_DAEMON);
  ck_assert_ptr_nonnull(strstr(dep_errmsg(c), "stale socket"));
  ck_assert_ptr_nonnull(strstr(dep_errmsg(c), sock));
  dep_client_free(c);
  tu_rmtree(dir);
}
END_TEST

START_TEST(too_long_path_is_invalid) {
  char path[300];
  memset(path, 'x', sizeof path - 1);
  path[0] = '/';
  path[sizeof path - 1] = '\0';
  dep_client_t *c = cl_new_client();
  ck_assert_int_eq(dep_connect(c, path), DEP_ERR_INVALID);
  ck_assert_ptr_nonnull(strstr(dep_errmsg(c), "longer than"));
  ck_assert_int_eq(dep_connect(c, ""), DEP_ERR_INVALID);
  dep_client_free(c);
}
END_TEST

START_TEST(socket_without_access_is_permission) {
  struct fake_daemon fake;
  fake_daemon_start(&fake, FAKE_SILENT_ATTACH);
  ck_assert_int_eq(chmod(fake.sock, 0600), 0);
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) {
    /* As root, become nobody: root passes every permission check. */
    if (geteuid() == 0 && (setgid(65534) != 0 || setuid(65534) != 0))
      _exit(10);
    dep_client_t *c = NULL;
    if (dep_client_new(&c) != 0)
      _exit(11);
    int rc = dep_connect(c, fake.sock);
    int named = strstr(dep_errmsg(c), fake.sock) != NULL && strstr(dep_errmsg(c), "group") != NULL;
    dep_client_free(c);
    _exit(rc == DEP_ERR_PERMISSION && named ? 0 : 12);
  }
  int st = 0;
  waitpid(pid, &st, 0);
  fake_daemon_stop(&fake);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "child status 0x%x", st);
}
END_TEST

START_TEST(handle_api_refuses_null_and_unconnected_use) {
  ck_assert_int_eq(dep_client_new(NULL), DEP_ERR_INVALID);
  ck_assert_int_eq(dep_connect(NULL, "/x"), DEP_ERR_INVALID);
  ck_assert_ptr_nonnull(dep_errmsg(NULL));
  dep_client_free(NULL);
  dep_client_t *c = cl_new_client();
  ck_assert_str_eq(dep_errmsg(c), "");
  ck_assert_int_eq(dep_status(c, NULL), DEP_ERR_INVALID);
  ck_assert_int_eq(dep_detach(c), DEP_ERR_STATE);
  ck_assert_ptr_nonnull(strstr(dep_errmsg(c), "dep_connect"));
  struct dep_attach_args a = cl_attach_args("job-a", 0);
  ck_assert_int_eq(dep_attach(c, &a), DEP_ERR_STATE);
  struct dep_attach_times tm = {.size = sizeof tm};
  ck_assert_int_eq(dep_attach_times(NULL, &tm), DEP_ERR_INVALID);
  ck_assert_int_eq(dep_attach_times(c, NULL), DEP_ERR_INVALID);
  ck_assert_int_eq(dep_attach_times(c, &tm), DEP_ERR_STATE);
  dep_client_free(c);
}
END_TEST

/* Invalid arguments are refused before the connection is even looked at. */
START_TEST(attach_with_invalid_args_is_invalid_and_names_the_field) {
  dep_client_t *c = cl_new_client();
  struct dep_attach_args a = cl_attach_args("job-a", 0);
  a.shape.hidden = 100;
  ck_assert_int_eq(dep_attach(c, &a), DEP_ERR_INVALID);
  ck_assert_ptr_nonnull(strstr(dep_errmsg(c), "hidden"));
  a = cl_attach_args("bad job id!", 0);
  ck_assert_int_eq(dep_attach(c, &a), DEP_ERR_INVALID);
  ck_assert_ptr_nonnull(strstr(dep_errmsg(c), "job_id"));
  a = cl_attach_args("job-a", 5);
  ck_assert_int_eq(dep_attach(c, &a), DEP_ERR_INVALID);
  ck_assert_ptr_nonnull(strstr(dep_errmsg(c), "rank"));
  ck_assert_int_eq(dep_attach(c, NULL), DEP_ERR_INVALID);
  dep_client_free(c);
}
END_TEST

/* Structs grow (deepep.h): a size below a struct's first layout is refused
 * naming the sizeof to set; a newer caller's larger struct is taken when its
 * extra bytes are zero (the call goes on: here to "not connected") and
 * refused when they are not.  All before the connection is looked at. */
START_TEST(struct_sizes_below_the_first_layout_are_invalid_and_say_what_to_set) {
  dep_client_t *c = cl_new_client();
  struct dep_attach_args a = cl_attach_args("job-a", 0);
  const uint32_t first = offsetof(struct dep_attach_args, shape) + sizeof a.shape;
  const uint32_t bad[] = {0, 4, first - 1};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    a.size = bad[i];
    ck_assert_int_eq(dep_attach(c, &a), DEP_ERR_INVALID);
    ck_assert_msg(strstr(dep_errmsg(c), "sizeof(struct dep_attach_args)") != NULL, "%u: %s",
                  bad[i], dep_errmsg(c));
  }
  struct {
    struct dep_attach_args a;
    uint64_t newer;
  } big = {.a = cl_attach_args("job-a", 0)};
  big.a.size = sizeof big;
  ck_assert_int_eq(dep_attach(c, &big.a), DEP_ERR_STATE); /* taken: on to "not connected" */
  ck_assert_ptr_nonnull(strstr(dep_errmsg(c), "dep_connect"));
  big.newer = 1;
  ck_assert_int_eq(dep_attach(c, &big.a), DEP_ERR_UNSUPPORTED);
  ck_assert_ptr_nonnull(strstr(dep_errmsg(c), "newer libdeepep-client"));
  struct dep_attach_info info = {.size = 0};
  ck_assert_int_eq(dep_attach_info(c, &info), DEP_ERR_INVALID);
  ck_assert_ptr_nonnull(strstr(dep_errmsg(c), "sizeof(struct dep_attach_info)"));
  struct dep_attach_times tm = {.size = sizeof tm - 1};
  ck_assert_int_eq(dep_attach_times(c, &tm), DEP_ERR_INVALID);
  ck_assert_ptr_nonnull(strstr(dep_errmsg(c), "sizeof(struct dep_attach_times)"));
  struct dep_status *st = NULL;
  ck_assert_int_eq(dep_status_sized(c, &st, sizeof *st, 8, sizeof(struct dep_status_job)),
                   DEP_ERR_INVALID);
  ck_assert_ptr_nonnull(strstr(dep_errmsg(c), "sizeof(struct dep_status_device)"));
  ck_assert_int_eq(dep_status_sized(c, &st, 12, sizeof(struct dep_status_device),
                                    sizeof(struct dep_status_job)), DEP_ERR_INVALID);
  ck_assert_ptr_nonnull(strstr(dep_errmsg(c), "sizeof(struct dep_status)"));
  ck_assert_ptr_null(st);
  struct dep_shape_sizes sz = {.size = 3};
  ck_assert_int_eq(dep_shape_sizes(c, &a.shape, 1, &sz), DEP_ERR_INVALID);
  ck_assert_ptr_nonnull(strstr(dep_errmsg(c), "sizeof(struct dep_shape_sizes)"));
  dep_client_free(c);
}
END_TEST

/* A size no sizeof gives (an unset field) is refused without reading past
 * the caller's struct: here the struct ends a mapping, zeros up to its end,
 * so a zero check that walked on to the size would fault. */
START_TEST(a_garbage_struct_size_is_invalid_without_reading_past_the_struct) {
  dep_client_t *c = cl_new_client();
  const long pg = sysconf(_SC_PAGESIZE);
  uint8_t *m = mmap(NULL, (size_t)pg * 2, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                    -1, 0);
  ck_assert_ptr_ne(m, MAP_FAILED);
  ck_assert_int_eq(munmap(m + pg, (size_t)pg), 0);
  struct dep_attach_args *a = (void *)(m + pg - sizeof *a);
  *a = cl_attach_args("job-a", 0);
  const uint32_t bad[] = {4097, 0x10000, 0xdeadbeef, UINT32_MAX};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    a->size = bad[i];
    ck_assert_int_eq(dep_attach(c, a), DEP_ERR_INVALID);
    ck_assert_msg(strstr(dep_errmsg(c), "not a sizeof") != NULL &&
                      strstr(dep_errmsg(c), "sizeof(struct dep_attach_args)") != NULL,
                  "%u: %s", bad[i], dep_errmsg(c));
  }
  struct dep_combine_args *ca = (void *)(m + pg - sizeof *ca);
  memset(ca, 0, sizeof *ca);
  ca->size = 0x10000000;
  ck_assert_int_eq(dep_combine(c, ca, NULL, NULL), DEP_ERR_INVALID);
  struct dep_status *st = NULL;
  ck_assert_int_eq(dep_status_sized(c, &st, sizeof *st, UINT32_MAX, sizeof(struct dep_status_job)),
                   DEP_ERR_INVALID);
  ck_assert_ptr_null(st);
  struct dep_shape_sizes *sz = (void *)(m + pg - sizeof *sz);
  memset(sz, 0, sizeof *sz);
  sz->size = 0xffff;
  ck_assert_int_eq(dep_shape_sizes(NULL, &a->shape, 1, sz), DEP_ERR_INVALID);
  munmap(m, (size_t)pg);
  dep_client_free(c);
}
END_TEST

/* ---- a real daemon ----------------------------------------------------------------- */

/*
 * A rank of a job that spans nodes on a daemon with no peers is attached but
 * has no operations: a handle's size is DEP_ERR_UNSUPPORTED as they are,
 * saying why.  dep_handle_bytes and dep_handle_new_in divided by the unset
 * context's world (SIGFPE).
 */
START_TEST(a_handle_of_a_job_without_operations_is_unsupported_not_a_crash) {
  struct tu_daemon d;
  ck_assert_int_eq(tu_daemon_start(&d, NULL), 0);
  dep_client_t *c = cl_connect(d.sock);
  struct dep_attach_args a = cl_attach_args("lonely", 0);
  a.local_world_size = 1;
  ck_assert_msg(dep_attach(c, &a) == 0, "%s", dep_errmsg(c));
  size_t bytes = 12345;
  ck_assert_int_eq(dep_handle_bytes(c, &bytes), DEP_ERR_UNSUPPORTED);
  ck_assert_msg(strstr(dep_errmsg(c), "dep_handle_bytes") != NULL &&
                    strstr(dep_errmsg(c), "spans nodes") != NULL, "%s", dep_errmsg(c));
  ck_assert_uint_eq(bytes, 12345);
  void *mem = aligned_alloc(DEP_HANDLE_ALIGN, 1 << 16);
  dep_handle_t *h = (dep_handle_t *)&bytes;
  ck_assert_int_eq(dep_handle_new_in(c, mem, 1 << 16, &h), DEP_ERR_UNSUPPORTED);
  ck_assert_ptr_null(h);
  free(mem);
  ck_assert_int_eq(dep_detach(c), 0);
  dep_client_free(c);
  tu_daemon_stop(&d);
  tu_daemon_cleanup(&d);
}
END_TEST

/* A daemon of its own and a world of one rank attached to it as job (max_tokens_per_rank 4). */
static dep_client_t *one_rank_job(struct tu_daemon *d, const char *job, struct dep_attach_args *a) {
  ck_assert_int_eq(tu_daemon_start(d, NULL), 0);
  dep_client_t *c = cl_connect(d->sock);
  *a = cl_attach_args(job, 0);
  a->world_size = a->local_world_size = 1;
  a->shape.max_tokens_per_rank = 4;
  ck_assert_msg(dep_attach(c, a) == 0, "%s", dep_errmsg(c));
  return c;
}

static void one_rank_end(struct tu_daemon *d, dep_client_t *c) {
  dep_client_free(c);
  tu_daemon_stop(d);
  tu_daemon_cleanup(d);
}

/*
 * A handle does not cross attachments: after dep_detach and a dep_attach to
 * another job of the same shape, a combine (or cached dispatch, or LL
 * combine) with a handle the earlier job's dispatch filled is
 * DEP_ERR_INVALID saying so; it ran, routing the new job's rows by the old
 * job's dispatch.  A new dispatch into the handle makes it this job's.
 */
START_TEST(a_handle_filled_in_an_earlier_attachment_is_refused) {
  struct tu_daemon d;
  struct dep_attach_args a;
  dep_client_t *c = one_rank_job(&d, "first", &a);
  int32_t idx[8] = {0, 1, 2, 3, 4, 5, 6, 7}, cnt[8], lcnt[8];
  float w[8] = {1, 1, 1, 1, 1, 1, 1, 1}, rw[8];
  static uint16_t x[4 * 256], rx[4 * 256], out[4 * 256], lx[8 * 4 * 256];
  int32_t ridx[8];
  uint32_t nr = 0;
  const struct dep_dispatch_args da = {.size = sizeof da, .x = x, .topk_idx = idx,
                                       .index_type = DEP_INDEX_I32, .topk_weights = w,
                                       .num_tokens = 4, .recv_x = rx, .recv_topk_idx = ridx,
                                       .recv_topk_weights = rw, .recv_count_per_expert = cnt,
                                       .num_recv = &nr};
  const struct dep_dispatch_args cached = {.size = sizeof cached, .x = x, .num_tokens = 4,
                                           .recv_x = rx, .num_recv = &nr, .cached = 1};
  const struct dep_combine_args ca = {.size = sizeof ca, .x = rx, .out = out};
  const struct dep_ll_dispatch_args ld = {.size = sizeof ld, .x = x, .topk_idx = idx,
                                          .index_type = DEP_INDEX_I32, .num_tokens = 4,
                                          .recv_x = lx, .recv_count = lcnt};
  const struct dep_ll_combine_args lc = {.size = sizeof lc, .x = lx, .topk_idx = idx,
                                         .index_type = DEP_INDEX_I32, .topk_weights = w,
                                         .out = out};
  dep_handle_t *h = NULL, *hl = NULL;
  ck_assert_int_eq(dep_handle_new(c, &h), 0);
  ck_assert_int_eq(dep_handle_new(c, &hl), 0);
  ck_assert_msg(dep_dispatch(c, &da, h, NULL) == 0 && nr == 4, "%s", dep_errmsg(c));
  ck_assert_msg(dep_ll_dispatch(c, &ld, hl, NULL) == 0, "%s", dep_errmsg(c));
  ck_assert_int_eq(dep_detach(c), 0);
  snprintf(a.job_id, sizeof a.job_id, "second");
  ck_assert_msg(dep_attach(c, &a) == 0, "%s", dep_errmsg(c));
  ck_assert_int_eq(dep_combine(c, &ca, h, NULL), DEP_ERR_INVALID);
  ck_assert_msg(strstr(dep_errmsg(c), "earlier attachment") != NULL, "%s", dep_errmsg(c));
  ck_assert_int_eq(dep_dispatch(c, &cached, h, NULL), DEP_ERR_INVALID);
  ck_assert_msg(strstr(dep_errmsg(c), "earlier attachment") != NULL, "%s", dep_errmsg(c));
  ck_assert_int_eq(dep_ll_combine(c, &lc, hl, NULL), DEP_ERR_INVALID);
  ck_assert_msg(strstr(dep_errmsg(c), "earlier attachment") != NULL, "%s", dep_errmsg(c));
  ck_assert_msg(dep_dispatch(c, &da, h, NULL) == 0, "%s", dep_errmsg(c));
  ck_assert_msg(dep_combine(c, &ca, h, NULL) == 0, "%s", dep_errmsg(c));
  ck_assert_msg(dep_dispatch(c, &cached, h, NULL) == 0, "%s", dep_errmsg(c));
  ck_assert_msg(dep_ll_dispatch(c, &ld, hl, NULL) == 0, "%s", dep_errmsg(c));
  ck_assert_msg(dep_ll_combine(c, &lc, hl, NULL) == 0, "%s", dep_errmsg(c));
  dep_handle_free(h);
  dep_handle_free(hl);
  one_rank_end(&d, c);
}
END_TEST

/*
 * An operation's refusal names the public function once: "dep_combine:
 * handle holds ...", not "dep_combine: combine: handle holds ..." (the
 * kernels' checks name the operation, and the library put its public
 * name before theirs).
 */
START_TEST(a_refused_operation_is_named_once) {
  struct tu_daemon d;
  struct dep_attach_args a;
  dep_client_t *c = one_rank_job(&d, "named", &a);
  int32_t idx[8] = {0}, tpr[1], tpe[8], cnt[8], lcnt[8];
  uint8_t in_rank[4];
  float w[8] = {1, 1, 1, 1, 1, 1, 1, 1}, rw[8];
  static uint16_t x[4 * 256], rx[4 * 256], out[4 * 256], lx[8 * 4 * 256];
  int32_t ridx[8];
  uint32_t nr = 0;
  const struct dep_layout_args la = {.size = sizeof la, .topk_idx = idx, .index_type = 0,
                                     .num_tokens = 4, .tokens_per_rank = tpr,
                                     .tokens_per_expert = tpe, .token_in_rank = in_rank};
  const struct dep_dispatch_args da = {.size = sizeof da, .x = x, .topk_idx = idx,
                                       .index_type = DEP_INDEX_I32, .topk_weights = w,
                                       .num_tokens = 4, .recv_x = rx, .recv_topk_idx = ridx,
                                       .recv_topk_weights = rw, .recv_count_per_expert = cnt,
                                       .num_recv = &nr, .use_fp8 = 5};
  const struct dep_combine_args ca = {.size = sizeof ca, .x = rx, .out = out};
  const struct dep_ll_dispatch_args ld = {.size = sizeof ld, .x = x, .topk_idx = idx,
                                          .index_type = DEP_INDEX_I32, .num_tokens = 4,
                                          .recv_x = lx, .recv_count = lcnt, .use_fp8 = 5};
  const struct dep_ll_combine_args lc = {.size = sizeof lc, .x = lx, .topk_idx = idx,
                                         .index_type = DEP_INDEX_I32, .topk_weights = w,
                                         .out = out};
  dep_handle_t *h = NULL;
  ck_assert_int_eq(dep_handle_new(c, &h), 0);
  ck_assert_int_eq(dep_layout(c, &la, NULL), DEP_ERR_INVALID);
  ck_assert_msg(strncmp(dep_errmsg(c), "dep_layout: index_type 0 ", 25) == 0, "%s",
                dep_errmsg(c));
  ck_assert_int_eq(dep_dispatch(c, &da, h, NULL), DEP_ERR_INVALID);
  ck_assert_msg(strncmp(dep_errmsg(c), "dep_dispatch: use_fp8 is 5", 26) == 0, "%s",
                dep_errmsg(c));
  ck_assert_int_eq(dep_combine(c, &ca, h, NULL), DEP_ERR_INVALID);
  ck_assert_msg(strncmp(dep_errmsg(c), "dep_combine: handle holds no dispatch", 37) == 0, "%s",
                dep_errmsg(c));
  ck_assert_int_eq(dep_ll_dispatch(c, &ld, h, NULL), DEP_ERR_INVALID);
  ck_assert_msg(strncmp(dep_errmsg(c), "dep_ll_dispatch: use_fp8 is 5", 29) == 0, "%s",
                dep_errmsg(c));
  ck_assert_int_eq(dep_ll_combine(c, &lc, h, NULL), DEP_ERR_INVALID);
  ck_assert_msg(strncmp(dep_errmsg(c), "dep_ll_combine: handle holds no dispatch", 40) == 0,
                "%s", dep_errmsg(c));
  dep_handle_free(h);
  one_rank_end(&d, c);
}
END_TEST

/* ---- a misbehaving peer ---------------------------------------------------------- */

START_TEST(fake_daemon_violations_are_refused) {
  static const struct {
    enum fake_script script;
    int connect_rc;
    int status_rc;
    const char *msg;
  } cases[] = {
      {FAKE_BAD_REQUEST_ID, DEP_ERR_PROTOCOL, 0, "request id"},
      {FAKE_VERSION_ERROR, DEP_ERR_VERSION, 0, "protocol 9"},
      {FAKE_SHUTDOWN, 0, DEP_ERR_DAEMON_GONE, "reconnect with dep_connect"},
      {FAKE_WRONG_TYPE, 0, DEP_ERR_PROTOCOL, "DETACH_OK"},
      /* An ERROR of another version is read (its layout never changes), so
       * the daemon's reason reaches the user rather than "bad frame". */
      {FAKE_OTHER_VERSION, DEP_ERR_VERSION, 0, "fake deepepd speaks protocol 9"},
      /* A reply of a type this library does not know fails the request. */
      {FAKE_UNKNOWN_REPLY, 0, DEP_ERR_PROTOCOL, "answered STATUS with message type"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    struct fake_daemon fake;
    fake_daemon_start(&fake, cases[i].script);
    dep_client_t *c = cl_new_client();
    int rc = dep_connect(c, fake.sock);
    ck_assert_int_eq(rc, cases[i].connect_rc);
    if (rc == 0) {
      struct dep_status *st = NULL;
      ck_assert_int_eq(dep_status(c, &st), cases[i].status_rc);
      ck_assert_ptr_null(st);
    }
    ck_assert_msg(strstr(dep_errmsg(c), cases[i].msg) != NULL, "case %zu: %s", i,
                  dep_errmsg(c));
    /* The connection is closed: further use says so instead of hanging. */
    struct dep_status *st = NULL;
    ck_assert_int_eq(dep_status(c, &st), DEP_ERR_STATE);
    ck_assert_ptr_nonnull(strstr(dep_errmsg(c), "dep_connect"));
    dep_client_free(c);
    fake_daemon_stop(&fake);
  }
}
END_TEST

/* Racing the daemon's close, the client still reports its reason. */
START_TEST(refusal_on_accept_reports_the_daemons_reason) {
  struct fake_daemon fake;
  fake_daemon_start(&fake, FAKE_REFUSE);
  dep_client_t *c = cl_new_client();
  for (int i = 0; i < FAKE_REFUSALS; i++) {
    ck_assert_int_eq(dep_connect(c, fake.sock), DEP_ERR_PERMISSION);
    ck_assert_msg(strstr(dep_errmsg(c), "not allowed by the fake deepepd") != NULL, "try %d: %s",
                  i, dep_errmsg(c));
    ck_assert_int_eq(dep_status(c, &(struct dep_status *){NULL}), DEP_ERR_STATE);
  }
  dep_client_free(c);
  fake_daemon_stop(&fake);
}
END_TEST

START_TEST(silent_attach_times_out_on_the_client) {
  struct fake_daemon fake;
  fake_daemon_start(&fake, FAKE_SILENT_ATTACH);
  setenv("DEEPEPD_ATTACH_TIMEOUT_MS", "200", 1);
  dep_client_t *c = cl_connect(fake.sock);
  struct dep_attach_args a = cl_attach_args("job-silent", 0);
  int64_t t0 = dw_now_ms();
  ck_assert_int_eq(dep_attach(c, &a), DEP_ERR_TIMEOUT);
  int64_t took = dw_now_ms() - t0;
  ck_assert_int_ge(took, 200);
  ck_assert_int_lt(took, 6000);
  ck_assert_ptr_nonnull(strstr(dep_errmsg(c), "job-silent"));
  ck_assert_int_eq(dep_attach(c, &a), DEP_ERR_STATE); /* closed after the timeout */
  dep_client_free(c);
  fake_daemon_stop(&fake);
}
END_TEST

START_TEST(bad_attach_timeout_env_is_invalid) {
  struct fake_daemon fake;
  fake_daemon_start(&fake, FAKE_SILENT_ATTACH);
  setenv("DEEPEPD_ATTACH_TIMEOUT_MS", "soon", 1);
  dep_client_t *c = cl_connect(fake.sock);
  struct dep_attach_args a = cl_attach_args("job-env", 0);
  ck_assert_int_eq(dep_attach(c, &a), DEP_ERR_INVALID);
  ck_assert_ptr_nonnull(strstr(dep_errmsg(c), "DEEPEPD_ATTACH_TIMEOUT_MS"));
  dep_client_free(c);
  fake_daemon_stop(&fake);
}
END_TEST

/*
 * The SM budget and $DEEPEP_KERNEL_CTAS (sm_budget.h), without a GPU: the
 * SMs shared out and capped; an override within the residency bound taken;
 * anything else refused with the bounds, and the default kept.
 */
START_TEST(kernel_ctas_override_is_bounded_and_refused_clearly) {
  uint32_t out = 0;
  char why[256] = "";
  ck_assert_int_eq(cuops_sm_budget(132, 1, 0, NULL, &out, why, sizeof why), 0);
  ck_assert_uint_eq(out, CUOPS_MAX_CTAS);
  ck_assert_int_eq(cuops_sm_budget(132, 8, 0, "", &out, why, sizeof why), 0);
  ck_assert_uint_eq(out, 16);
  ck_assert_int_eq(cuops_sm_budget(132, 2, 0, "132", &out, why, sizeof why), 0);
  ck_assert_uint_eq(out, 132);
  ck_assert_int_eq(cuops_sm_budget(132, 1, 0, "264", &out, why, sizeof why), 0); /* 2 per SM */
  ck_assert_uint_eq(out, 264);
  static const char *const bad[] = {"0",    "265",  "-5",  "+5", " 5",
                                    "12x",  "lots", "99999999999999999999"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    out = 7;
    why[0] = '\0';
    ck_assert_int_eq(cuops_sm_budget(132, 1, 0, bad[i], &out, why, sizeof why), DEP_ERR_INVALID);
    ck_assert_msg(strstr(why, "DEEPEP_KERNEL_CTAS") != NULL && strstr(why, "from 1 to 264") != NULL,
                  "%s: said %s", bad[i], why);
    ck_assert_uint_eq(out, CUOPS_MAX_CTAS); /* the default stands */
  }
  /* Eight ranks on the GPU: each may have at most a quarter of its SMs' CTAs. */
  ck_assert_int_eq(cuops_sm_budget(132, 8, 0, "34", &out, why, sizeof why), DEP_ERR_INVALID);
  ck_assert_msg(strstr(why, "from 1 to 33 (132 SMs, 8 ranks") != NULL, "said %s", why);
}
END_TEST

/*
 * The grid of a communicating cuda kernel (dep__kernel_grid, kabi.h "SM
 * budget"), without a GPU: never more CTAs than the rank's budget,
 * whatever the world (the old grid was world * parts, at least the world:
 * 16 ranks sharing one H100 under MPS, budget 8 each, launched 16 CTAs
 * each, 256 of the GPU's 264 resident places), and where the world fits the
 * budget the grid is what it was, world * parts with parts = budget / world.
 */
START_TEST(kernel_grid_never_exceeds_the_budget) {
  uint32_t parts = 0;
  ck_assert_uint_eq(dep__kernel_grid(8, 16, &parts), 8); /* 16 ranks on one H100 */
  ck_assert_uint_eq(parts, 1);
  ck_assert_uint_eq(dep__kernel_grid(2, 8, &parts), 2); /* $DEEPEP_KERNEL_CTAS=2 at world 8 */
  ck_assert_uint_eq(parts, 1);
  ck_assert_uint_eq(dep__kernel_grid(1, 4, &parts), 1);
  ck_assert_uint_eq(parts, 1);
  ck_assert_uint_eq(dep__kernel_grid(96, 1024, &parts), 96); /* a world no GPU holds a CTA of each */
  ck_assert_uint_eq(parts, 1);
  ck_assert_uint_eq(dep__kernel_grid(96, 8, &parts), 96); /* 12 parts a destination, as before */
  ck_assert_uint_eq(parts, 12);
  ck_assert_uint_eq(dep__kernel_grid(16, 6, &parts), 12); /* 2 parts; 4 CTAs of the budget unused */
  ck_assert_uint_eq(parts, 2);
  for (uint32_t b = 1; b <= 2 * CUOPS_MAX_CTAS; b++)
    for (uint32_t w = 1; w <= 2 * CUOPS_MAX_RANKS; w++) {
      const uint32_t g = dep__kernel_grid(b, w, &parts);
      ck_assert_uint_eq(parts, b / w < 1 ? 1 : b / w);
      ck_assert_msg(g >= 1 && g <= b && g <= w * parts, "budget %u world %u: grid %u", b, w, g);
      if (b >= w) /* it fits: one unit a CTA, as before */
        ck_assert_uint_eq(g, w * parts);
      else /* each CTA loops over the units b apart */
        ck_assert_uint_eq(g, b);
    }
}
END_TEST

/*
 * A job across nodes (dep__xnode_budget): the default budget is at most two
 * CTAs a rank of the world, so its kernels split a destination's rows in at
 * most two parts; a smaller budget (many ranks on a GPU, or a large world)
 * is left as it is.
 */
START_TEST(a_job_across_nodes_runs_at_most_two_parts_a_destination) {
  uint32_t parts = 0;
  ck_assert_uint_eq(dep__xnode_budget(96, 2), 4); /* 1+1, a rank alone on its GPU: 48 parts before */
  ck_assert_uint_eq(dep__kernel_grid(dep__xnode_budget(96, 2), 2, &parts), 4);
  ck_assert_uint_eq(parts, CUOPS_XNODE_PARTS);
  ck_assert_uint_eq(dep__xnode_budget(66, 4), 8);   /* 2+2 on one GPU */
  ck_assert_uint_eq(dep__xnode_budget(96, 16), 32); /* two nodes of 8 */
  ck_assert_uint_eq(dep__xnode_budget(96, 256), 96);
  ck_assert_uint_eq(dep__xnode_budget(16, 16), 16);
  ck_assert_uint_eq(dep__xnode_budget(0, 0), 1);
  for (uint32_t w = 1; w <= 2 * CUOPS_MAX_RANKS; w++) {
    const uint32_t b = dep__xnode_budget(CUOPS_MAX_CTAS, w);
    dep__kernel_grid(b, w, &parts);
    ck_assert_msg(b >= 1 && b <= CUOPS_MAX_CTAS && parts <= CUOPS_XNODE_PARTS,
                  "world %u: budget %u, %u parts", w, b, parts);
  }
}
END_TEST

/*
 * The slab's private area (slab.h) holds the cuda library's operation
 * memory, carved by one function (dep__slab_priv) whose end is the area's
 * size: without a GPU, for shapes at the ends of every range, the parts
 * lie in order inside the area, which is no larger than the carving needs
 * (rounded to a page), and the library's view for GPUs of 1 to
 * DEP_SLAB_MAX_SMS SMs is that same carving; a GPU beyond the bound is
 * refused, not overrun.
 */
START_TEST(the_operations_memory_fits_every_slabs_private_area) {
  static const uint32_t hiddens[] = {128, 7168, 16384}, tokens[] = {1, 128, 4096, 65536};
  static const uint32_t worlds[] = {1, 2, 8, 64, 4096}, topks[] = {1, 8, 16};
  static const int sms[] = {1, 132, (int)DEP_SLAB_MAX_SMS};
  char why[256];
  unsigned checked = 0;
  for (size_t hi = 0; hi < 3; hi++)
    for (size_t ti = 0; ti < 4; ti++)
      for (size_t wi = 0; wi < 5; wi++)
        for (size_t ki = 0; ki < 3; ki++)
          for (uint32_t ll_max = 0; ll_max < 2; ll_max++) {
            uint32_t W = worlds[wi], mt = tokens[ti];
            struct dep_job_shape sh = {.max_tokens_per_rank = mt, .hidden = hiddens[hi],
                                       .num_experts = ki == 2 ? 65536 : W * (W < 256 ? 256 / W : 1),
                                       .topk = topks[ki], .dtype = DEP_DTYPE_BF16,
                                       .max_ll_tokens_per_rank = ll_max ? mt : 0};
            struct dep_slab_layout l;
            ck_assert_msg(dep__slab_layout(&sh, W, &l, why, sizeof why) == 0, "%s", why);
            ck_assert_uint_eq(l.priv_off % DEP_SLAB_ALIGN, 0);
            ck_assert_uint_ge(l.priv_off, l.data_off + 2 * l.parity_bytes);
            ck_assert_uint_eq(l.total_bytes, l.priv_off + l.priv_bytes);
            struct dep_slab_priv p;
            dep__slab_priv(&sh, W, &l, &p);
            /* The counters per rank of the world, the own and pending masks' words and the
             * rank tables (kabi.h cuops_world_carve) after the cuops_dev, for the job's
             * world and the warm-up's world of one. */
            uint64_t wat[CUOPS_WORLD_ARRAYS];
            const uint64_t wb = cuops_world_carve(W, wat), wb1 = cuops_world_carve(1, wat);
            ck_assert_uint_ge(wb, (4 + 8 + 8 + 4 + 8 + 8 + 4) * (uint64_t)W +
                                      3 * 8 * DEP_SLAB_MASK_WORDS(W)); /* own, pend[2] */
            ck_assert(p.dev + sizeof(struct cuops_dev) <= p.world && p.world + wb <= p.scratch &&
                      p.scratch < p.stage && p.stage < p.tcnt &&
                      p.tcnt + p.tcnt_bytes <= p.loop_dev &&
                      p.loop_dev + sizeof(struct cuops_dev) <= p.loop_world &&
                      p.loop_world + wb1 <= p.loop_slab &&
                      p.loop_slab + l.data_off + 4096 <= p.warm_handle &&
                      p.warm_handle < p.end);
            ck_assert_uint_eq(l.priv_bytes, dep_round_up(p.end, DEP_SLAB_ALIGN));
            for (size_t si = 0; si < 3; si++) {
              struct dep_slab_priv b;
              ck_assert_msg(cuops_block_layout(&sh, W, &l, sms[si], &b, why, sizeof why) == 0,
                            "hidden %u, %u tokens, world %u, top-%u, %d SMs: %s", sh.hidden, mt,
                            W, sh.topk, sms[si], why);
              ck_assert(memcmp(&b, &p, sizeof b) == 0);
              /* The count scratch holds a word per warp of the most CTAs the SMs allow. */
              ck_assert_uint_ge(b.tcnt_bytes,
                                ((uint64_t)CUOPS_CTAS_PER_SM * (uint64_t)sms[si] + W) *
                                    CUOPS_WARPS * 4);
              checked++;
            }
          }
  ck_assert_uint_eq(checked, 3 * 4 * 5 * 3 * 2 * 3);
  struct dep_job_shape sh = {.max_tokens_per_rank = 4096, .hidden = 7168, .num_experts = 256,
                             .topk = 8, .dtype = DEP_DTYPE_BF16};
  struct dep_slab_layout l;
  struct dep_slab_priv b;
  ck_assert_int_eq(dep__slab_layout(&sh, 8, &l, why, sizeof why), 0);
  ck_assert_int_eq(cuops_block_layout(&sh, 8, &l, DEP_SLAB_MAX_SMS + 1, &b, why, sizeof why),
                   DEP_ERR_UNSUPPORTED);
  ck_assert_msg(strstr(why, "private area") != NULL, "said %s", why);
  ck_assert_int_eq(cuops_block_layout(&sh, 8, &l, 0, &b, why, sizeof why), DEP_ERR_UNSUPPORTED);
  /* A job that streams (channels of 64 rows): the kernels stream within a node and across
   * nodes, so both layouts are bound, carved as every other (the old library refused the one
   * across nodes, DEP_ERR_UNSUPPORTED, leaving it whole blocks of pinned host memory). */
  struct dep_slab_priv p;
  ck_assert_int_eq(dep__slab_layout_nodes(&sh, 8, 8, 16, &l, why, sizeof why), 0);
  ck_assert_msg(cuops_block_layout(&sh, 8, &l, 132, &b, why, sizeof why) == 0, "%s", why);
  ck_assert_int_eq(dep__slab_layout_nodes(&sh, 16, 8, 16, &l, why, sizeof why), 0);
  ck_assert_msg(cuops_block_layout(&sh, 16, &l, 132, &b, why, sizeof why) == 0, "%s", why);
  dep__slab_priv(&sh, 16, &l, &p);
  ck_assert(memcmp(&b, &p, sizeof b) == 0);
}
END_TEST

/*
 * A rank lets go of its slabs before the daemon hears that it leaves (the
 * daemon may then scrub the memory and lend it to another job at once):
 * through dep_detach, and through dep_client_free of an attached handle.
 */
START_TEST(slabs_are_unmapped_before_the_daemon_hears_detach) {
  for (int by_free = 0; by_free <= 1; by_free++) {
    struct fake_daemon fake;
    fake_daemon_start(&fake, FAKE_ATTACH_UNMAP);
    dep_client_t *c = cl_connect(fake.sock);
    struct dep_attach_args a = cl_attach_args("job-unmap", 0);
    ck_assert_int_eq(dep_attach(c, &a), DEP_OK);
    if (!by_free)
      ck_assert_int_eq(dep_detach(c), DEP_OK);
    dep_client_free(c);
    ck_assert_msg(fake_daemon_wait(&fake) == 0, "DETACH came while the slabs were mapped (%s)",
                  by_free ? "dep_client_free" : "dep_detach");
  }
}
END_TEST

START_TEST(attach_reply_fds_never_leak) {
  for (int lie = 0; lie <= 1; lie++) {
    struct fake_daemon fake;
    fake_daemon_start(&fake, lie ? FAKE_ATTACH_FDS_LIE : FAKE_ATTACH_FDS);
    dep_client_t *c = cl_new_client();
    int before = count_open_fds();
    ck_assert_int_eq(dep_connect(c, fake.sock), 0);
    struct dep_attach_args a = cl_attach_args("job-fds", 0);
    if (lie) {
      ck_assert_int_eq(dep_attach(c, &a), DEP_ERR_PROTOCOL);
      ck_assert_ptr_nonnull(strstr(dep_errmsg(c), "announces 1"));
      ck_assert_int_eq(count_open_fds(), before); /* both fds and the socket closed */
    } else {
      ck_assert_int_eq(dep_attach(c, &a), DEP_OK);
      ck_assert_int_eq(count_open_fds(), before + 1); /* only the socket */
      ck_assert_int_eq(dep_detach(c), DEP_OK);
    }
    dep_client_free(c);
    ck_assert_int_eq(count_open_fds(), before);
    fake_daemon_stop(&fake);
  }
}
END_TEST

/* ---- the shared library's ABI ----------------------------------------------------------- */

/* deepep(3)'s SYNOPSIS lists every function the version script exports (it
 * lacked the five operations, which a reader of the page never learnt of). */
START_TEST(the_man_page_synopsis_lists_every_exported_function) {
  char *map = dw_slurp("client/libdeepep-client.map"), *man = dw_slurp("man/deepep.3");
  ck_assert_msg(map[0] != '\0' && man[0] != '\0', "run from the repository root");
  char *syn = strstr(man, ".SH SYNOPSIS"), *end = syn ? strstr(syn, ".SH DESCRIPTION") : NULL;
  ck_assert_msg(syn != NULL && end != NULL, "man/deepep.3 has no SYNOPSIS before DESCRIPTION");
  *end = '\0';
  int n = 0;
  for (char *line = strtok(map, "\n"); line != NULL; line = strtok(NULL, "\n")) {
    char name[64], call[80];
    if (sscanf(line, " %63[a-z_]; ", name) != 1 || strncmp(name, "dep_", 4) != 0)
      continue;
    snprintf(call, sizeof call, "%s(", name);
    ck_assert_msg(strstr(syn, call) != NULL, "deepep(3)'s SYNOPSIS does not list %s", name);
    n++;
  }
  ck_assert_int_ge(n, 20);
  free(map);
  free(man);
}
END_TEST

/*
 * The reference oracle (tests/ref.c) is the tests' measure of the
 * operations, never shipped code: neither the library (shared or static)
 * nor deepepd nor deepepctl carries a ref_ symbol.  nm reads each whole
 * symbol table, local symbols included, and must find the protocol's
 * codec_w_u32 in each: a stripped file, which would hide a ref_ symbol
 * too, fails rather than passes.
 */
START_TEST(the_shipped_library_and_programs_carry_no_test_oracle) {
  const char *shipped[] = {"libdeepep-client.so", "libdeepep-client.a", "deepepd", "deepepctl"};
  for (size_t i = 0; i < sizeof shipped / sizeof shipped[0]; i++) {
    char cmd[700], line[512];
    snprintf(cmd, sizeof cmd, "nm %s 2>&1", tu_bin(shipped[i]));
    FILE *p = popen(cmd, "r");
    ck_assert_ptr_nonnull(p);
    bool codec = false;
    while (fgets(line, sizeof line, p) != NULL) {
      line[strcspn(line, "\n")] = '\0';
      const char *name = strrchr(line, ' ');
      name = name != NULL ? name + 1 : line;
      ck_assert_msg(strncmp(name, "ref_", 4) != 0, "%s carries the oracle's %s", shipped[i],
                    name);
      codec |= strcmp(name, "codec_w_u32") == 0;
    }
    ck_assert_msg(pclose(p) == 0, "nm %s failed (binutils)", tu_bin(shipped[i]));
    ck_assert_msg(codec, "nm %s shows no local symbols (stripped?)", tu_bin(shipped[i]));
  }
}
END_TEST

START_TEST(shared_library_exports_only_dep_symbols) {
  char cmd[700], line[512];
  snprintf(cmd, sizeof cmd, "nm -D --defined-only %s 2>&1", tu_bin("libdeepep-client.so"));
  FILE *p = popen(cmd, "r");
  ck_assert_ptr_nonnull(p);
  int n = 0, core = 0;
  while (fgets(line, sizeof line, p) != NULL) {
    char addr[64], type[8], name[256];
    if (sscanf(line, "%63s %7s %255s", addr, type, name) != 3)
      ck_abort_msg("unexpected nm line: %s", line);
    name[strcspn(name, "@")] = '\0';
    if (strcmp(name, "DEEPEP_0") == 0) /* the version node */
      continue;
    ck_assert_msg(strncmp(name, "dep_", 4) == 0, "exported non-API symbol %s", name);
    n++;
    core += strcmp(name, "dep_connect") == 0 || strcmp(name, "dep_status_sized") == 0 ||
            strcmp(name, "dep_attach") == 0 || strcmp(name, "dep_strerror") == 0 ||
            strcmp(name, "dep_status_free") == 0;
  }
  ck_assert_int_eq(pclose(p), 0);
  ck_assert_int_eq(core, 5);
  ck_assert_int_ge(n, 10);

  snprintf(cmd, sizeof cmd, "readelf -d %s 2>&1", tu_bin("libdeepep-client.so"));
  p = popen(cmd, "r");
  ck_assert_ptr_nonnull(p);
  bool soname = false;
  while (fgets(line, sizeof line, p) != NULL)
    if (strstr(line, "(SONAME)") != NULL)
      soname = strstr(line, "[libdeepep-client.so.0]") != NULL;
  ck_assert_int_eq(pclose(p), 0);
  ck_assert_msg(soname, "SONAME is not libdeepep-client.so.0");
}
END_TEST

Suite *client_suite(void);
Suite *client_suite(void) {
  Suite *s = suite_create("client");
  TCase *local = tcase_create("no_daemon");
  tcase_add_test(local, missing_socket_is_no_daemon_naming_path_and_remedy);
  tcase_add_test(local, env_socket_is_used_and_named);
  tcase_add_test(local, stale_socket_is_no_daemon);
  tcase_add_test(local, too_long_path_is_invalid);
  tcase_add_test(local, socket_without_access_is_permission);
  tcase_add_test(local, handle_api_refuses_null_and_unconnected_use);
  tcase_add_test(local, attach_with_invalid_args_is_invalid_and_names_the_field);
  tcase_add_test(local, struct_sizes_below_the_first_layout_are_invalid_and_say_what_to_set);
  tcase_add_test(local, a_garbage_struct_size_is_invalid_without_reading_past_the_struct);
  tcase_add_test(local, shared_library_exports_only_dep_symbols);
  tcase_add_test(local, the_shipped_library_and_programs_carry_no_test_oracle);
  tcase_add_test(local, the_man_page_synopsis_lists_every_exported_function);
  tcase_add_test(local, kernel_ctas_override_is_bounded_and_refused_clearly);
  tcase_add_test(local, a_job_across_nodes_runs_at_most_two_parts_a_destination);
  tcase_add_test(local, kernel_grid_never_exceeds_the_budget);
  tcase_add_test(local, the_operations_memory_fits_every_slabs_private_area);
  suite_add_tcase(s, local);

  TCase *real = tcase_create("daemon");
  tcase_set_timeout(real, 20);
  tcase_add_test(real, a_handle_of_a_job_without_operations_is_unsupported_not_a_crash);
  tcase_add_test(real, a_handle_filled_in_an_earlier_attachment_is_refused);
  tcase_add_test(real, a_refused_operation_is_named_once);
  suite_add_tcase(s, real);
  TCase *fake = tcase_create("fake_daemon");
  tcase_add_test(fake, fake_daemon_violations_are_refused);
  tcase_add_test(fake, refusal_on_accept_reports_the_daemons_reason);
  tcase_add_test(fake, silent_attach_times_out_on_the_client);
  tcase_add_test(fake, bad_attach_timeout_env_is_invalid);
  tcase_add_test(fake, attach_reply_fds_never_leak);
  tcase_add_test(fake, slabs_are_unmapped_before_the_daemon_hears_detach);
  tcase_set_timeout(fake, 30);
  suite_add_tcase(s, fake);
  return s;
}
