/*
 * check_client.c — libdeepep-client and deepepctl as a specification, through
 * real processes: a missing or stale daemon gives an error that says where
 * it looked and how to start one; status, attach and detach work against a
 * real deepepd; a daemon that goes away is noticed at once, never a hang;
 * a misbehaving peer (a scripted fake daemon) is refused with the right
 * code and leaks no fd; deepepctl prints, exits and speaks JSON as its man
 * page says; the shared library exports only dep_* under its SONAME.
 */
#include <check.h>
#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cuda_ops.h"
#include "deepep.h"
#include "fake_daemon.h"
#include "proto.h"
#include "slab.h"
#include "testutil.h"

/* ---- helpers ------------------------------------------------------------- */

static int64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

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

static dep_client_t *new_client(void) {
  dep_client_t *c = NULL;
  ck_assert_int_eq(dep_client_new(&c), DEP_OK);
  ck_assert_ptr_nonnull(c);
  return c;
}

/* A valid attach for rank `rank` of a two-rank, one-node job. */
static struct dep_attach_args attach_args(const char *job, uint32_t rank) {
  struct dep_attach_args a;
  memset(&a, 0, sizeof a);
  a.size = sizeof a;
  snprintf(a.job_id, sizeof a.job_id, "%s", job);
  a.rank = rank;
  a.world_size = 2;
  a.local_rank = rank;
  a.local_world_size = 2;
  a.shape = (struct dep_job_shape){.max_tokens_per_rank = 128, .hidden = 256,
                                   .num_experts = 8, .topk = 2, .dtype = DEP_DTYPE_BF16};
  return a;
}

/* Run deepepctl with args; stdout and stderr come back malloc'd. */
static int run_ctl(const char *const *args, char **out, char **err) {
  char dir[200];
  tu_tmpdir(dir, sizeof dir);
  char fout[256], ferr[256];
  snprintf(fout, sizeof fout, "%s/out", dir);
  snprintf(ferr, sizeof ferr, "%s/err", dir);
  const char *argv[16] = {"deepepctl"};
  int n = 1;
  for (; args[n - 1] != NULL && n < 15; n++)
    argv[n] = args[n - 1];
  argv[n] = NULL;
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) {
    int o = open(fout, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    int e = open(ferr, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (o < 0 || e < 0)
      _exit(126);
    dup2(o, 1);
    dup2(e, 2);
    execv(tu_bin("deepepctl"), (char *const *)argv);
    _exit(127);
  }
  int st = 0;
  ck_assert_int_eq(waitpid(pid, &st, 0), pid);
  struct tu_daemon fake = {0};
  snprintf(fake.log, sizeof fake.log, "%s", fout);
  *out = tu_daemon_log(&fake); /* reads a whole file */
  snprintf(fake.log, sizeof fake.log, "%s", ferr);
  *err = tu_daemon_log(&fake);
  tu_rmtree(dir);
  ck_assert_msg(WIFEXITED(st), "deepepctl did not exit normally (status 0x%x)", st);
  return WEXITSTATUS(st);
}

/* ---- no daemon -------------------------------------------------------------- */

START_TEST(missing_socket_is_no_daemon_naming_path_and_remedy) {
  char dir[200], sock[256];
  tu_tmpdir(dir, sizeof dir);
  snprintf(sock, sizeof sock, "%s/absent.sock", dir);
  dep_client_t *c = new_client();
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
  dep_client_t *c = new_client();
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
  dep_client_t *c = new_client();
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
  dep_client_t *c = new_client();
  ck_assert_int_eq(dep_connect(c, path), DEP_ERR_INVALID);
  ck_assert_ptr_nonnull(strstr(dep_errmsg(c), "longer than"));
  ck_assert_int_eq(dep_connect(c, ""), DEP_ERR_INVALID);
  dep_client_free(c);
}
END_TEST

START_TEST(socket_without_access_is_permission) {
  char dir[200], sock[256];
  tu_tmpdir(dir, sizeof dir);
  pid_t fake = fake_daemon_start(dir, sock, sizeof sock, FAKE_SILENT_ATTACH);
  ck_assert_int_eq(chmod(sock, 0600), 0);
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) {
    /* As root, become nobody: root passes every permission check. */
    if (geteuid() == 0 && (setgid(65534) != 0 || setuid(65534) != 0))
      _exit(10);
    dep_client_t *c = NULL;
    if (dep_client_new(&c) != 0)
      _exit(11);
    int rc = dep_connect(c, sock);
    int named = strstr(dep_errmsg(c), sock) != NULL && strstr(dep_errmsg(c), "group") != NULL;
    dep_client_free(c);
    _exit(rc == DEP_ERR_PERMISSION && named ? 0 : 12);
  }
  int st = 0;
  waitpid(pid, &st, 0);
  fake_daemon_stop(fake);
  tu_rmtree(dir);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "child status 0x%x", st);
}
END_TEST

START_TEST(handle_api_refuses_null_and_unconnected_use) {
  ck_assert_int_eq(dep_client_new(NULL), DEP_ERR_INVALID);
  ck_assert_int_eq(dep_connect(NULL, "/x"), DEP_ERR_INVALID);
  ck_assert_ptr_nonnull(dep_errmsg(NULL));
  dep_client_free(NULL);
  dep_client_t *c = new_client();
  ck_assert_str_eq(dep_errmsg(c), "");
  ck_assert_int_eq(dep_status(c, NULL), DEP_ERR_INVALID);
  ck_assert_int_eq(dep_detach(c), DEP_ERR_STATE);
  ck_assert_ptr_nonnull(strstr(dep_errmsg(c), "dep_connect"));
  struct dep_attach_args a = attach_args("job-a", 0);
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
  dep_client_t *c = new_client();
  struct dep_attach_args a = attach_args("job-a", 0);
  a.shape.hidden = 100;
  ck_assert_int_eq(dep_attach(c, &a), DEP_ERR_INVALID);
  ck_assert_ptr_nonnull(strstr(dep_errmsg(c), "hidden"));
  a = attach_args("bad job id!", 0);
  ck_assert_int_eq(dep_attach(c, &a), DEP_ERR_INVALID);
  ck_assert_ptr_nonnull(strstr(dep_errmsg(c), "job_id"));
  a = attach_args("job-a", 5);
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
  dep_client_t *c = new_client();
  struct dep_attach_args a = attach_args("job-a", 0);
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
  } big = {.a = attach_args("job-a", 0)};
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

static bool all_zero(const void *p, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (((const uint8_t *)p)[i] != 0)
      return false;
  return true;
}

/* A newer caller's larger structs (zero past this library's fields) are
 * filled as far as this library knows them, `size` says how far, the rest
 * stays zero; dep_status lays its arrays out at the caller's element sizes. */
START_TEST(larger_structs_are_filled_as_far_as_the_library_knows_them) {
  struct tu_daemon d;
  ck_assert_int_eq(tu_daemon_start(&d, NULL), 0);
  dep_client_t *c = new_client();
  ck_assert_msg(dep_connect(c, d.sock) == 0, "%s", dep_errmsg(c));
  struct {
    struct dep_attach_args a;
    uint8_t newer[24];
  } ba = {.a = attach_args("job-sized", 0)};
  ba.a.size = sizeof ba;
  ba.a.world_size = ba.a.local_world_size = 1;
  ck_assert_msg(dep_attach(c, &ba.a) == 0, "%s", dep_errmsg(c));
  struct {
    struct dep_attach_info i;
    uint8_t newer[40];
  } bi = {.i.size = sizeof bi};
  ck_assert_msg(dep_attach_info(c, &bi.i) == 0, "%s", dep_errmsg(c));
  ck_assert_uint_eq(bi.i.size, sizeof(struct dep_attach_info));
  ck_assert_str_eq(bi.i.backend, "host");
  ck_assert_uint_gt(bi.i.slab_bytes, 0);
  ck_assert_ptr_nonnull(bi.i.slabs[0]);
  ck_assert(all_zero(bi.newer, sizeof bi.newer));
  struct {
    struct dep_attach_times t;
    uint8_t newer[16];
  } bt = {.t.size = sizeof bt};
  ck_assert_msg(dep_attach_times(c, &bt.t) == 0, "%s", dep_errmsg(c));
  ck_assert_uint_eq(bt.t.size, sizeof(struct dep_attach_times));
  ck_assert(bt.t.total_ms > 0 && all_zero(bt.newer, sizeof bt.newer));
  struct {
    struct dep_shape_sizes s;
    uint8_t newer[8];
  } bs = {.s.size = sizeof bs};
  ck_assert_msg(dep_shape_sizes(c, &ba.a.shape, 1, &bs.s) == 0, "%s", dep_errmsg(c));
  ck_assert_uint_eq(bs.s.size, sizeof(struct dep_shape_sizes));
  ck_assert_uint_eq(bs.s.recv_rows, ba.a.shape.max_tokens_per_rank);
  ck_assert(all_zero(bs.newer, sizeof bs.newer));

  const uint32_t top = sizeof(struct dep_status) + 8, dsz = sizeof(struct dep_status_device) + 24,
                 jsz = sizeof(struct dep_status_job) + 40;
  struct dep_status *st = NULL, *plain = NULL;
  ck_assert_msg(dep_status_sized(c, &st, top, dsz, jsz) == 0, "%s", dep_errmsg(c));
  ck_assert_msg(dep_status(c, &plain) == 0, "%s", dep_errmsg(c));
  ck_assert_uint_eq(st->size, sizeof(struct dep_status));
  ck_assert_uint_eq(st->device_size, sizeof(struct dep_status_device));
  ck_assert_uint_eq(st->job_size, sizeof(struct dep_status_job));
  ck_assert_uint_eq(plain->device_size, sizeof(struct dep_status_device));
  ck_assert(all_zero((const uint8_t *)st + sizeof(struct dep_status), 8));
  ck_assert_uint_eq(st->num_jobs, 1);
  ck_assert_uint_eq(st->num_devices, plain->num_devices);
  ck_assert_uint_ge(st->num_devices, 1);
  for (uint32_t i = 0; i < st->num_devices; i++) {
    const uint8_t *e = (const uint8_t *)st->devices + (size_t)i * dsz;
    const struct dep_status_device *dv = (const void *)e;
    ck_assert_str_eq(dv->name, plain->devices[i].name);
    ck_assert_uint_eq(dv->pool_total_bytes, plain->devices[i].pool_total_bytes);
    ck_assert(all_zero(e + sizeof *dv, dsz - sizeof *dv));
  }
  const struct dep_status_job *j = (const void *)st->jobs;
  ck_assert_str_eq(j->job_id, "job-sized");
  ck_assert_str_eq(plain->jobs[0].job_id, "job-sized");
  ck_assert_uint_eq(j->world_size, 1);
  ck_assert(all_zero((const uint8_t *)j + sizeof *j, jsz - sizeof *j));
  dep_status_free(st);
  dep_status_free(plain);
  ck_assert_int_eq(dep_detach(c), 0);
  dep_client_free(c);
  tu_daemon_stop(&d);
  tu_daemon_cleanup(&d);
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
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char dir[200], sock[256];
    tu_tmpdir(dir, sizeof dir);
    pid_t fake = fake_daemon_start(dir, sock, sizeof sock, cases[i].script);
    dep_client_t *c = new_client();
    int rc = dep_connect(c, sock);
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
    fake_daemon_stop(fake);
    tu_rmtree(dir);
  }
}
END_TEST

/* Racing the daemon's close, the client still reports its reason. */
START_TEST(refusal_on_accept_reports_the_daemons_reason) {
  char dir[200], sock[256];
  tu_tmpdir(dir, sizeof dir);
  pid_t fake = fake_daemon_start(dir, sock, sizeof sock, FAKE_REFUSE);
  dep_client_t *c = new_client();
  for (int i = 0; i < FAKE_REFUSALS; i++) {
    ck_assert_int_eq(dep_connect(c, sock), DEP_ERR_PERMISSION);
    ck_assert_msg(strstr(dep_errmsg(c), "not allowed by the fake deepepd") != NULL, "try %d: %s",
                  i, dep_errmsg(c));
    ck_assert_int_eq(dep_status(c, &(struct dep_status *){NULL}), DEP_ERR_STATE);
  }
  dep_client_free(c);
  fake_daemon_stop(fake);
  tu_rmtree(dir);
}
END_TEST

START_TEST(silent_attach_times_out_on_the_client) {
  char dir[200], sock[256];
  tu_tmpdir(dir, sizeof dir);
  pid_t fake = fake_daemon_start(dir, sock, sizeof sock, FAKE_SILENT_ATTACH);
  setenv("DEEPEPD_ATTACH_TIMEOUT_MS", "200", 1);
  dep_client_t *c = new_client();
  ck_assert_int_eq(dep_connect(c, sock), 0);
  struct dep_attach_args a = attach_args("job-silent", 0);
  int64_t t0 = now_ms();
  ck_assert_int_eq(dep_attach(c, &a), DEP_ERR_TIMEOUT);
  int64_t took = now_ms() - t0;
  ck_assert_int_ge(took, 200);
  ck_assert_int_lt(took, 6000);
  ck_assert_ptr_nonnull(strstr(dep_errmsg(c), "job-silent"));
  ck_assert_int_eq(dep_attach(c, &a), DEP_ERR_STATE); /* closed after the timeout */
  dep_client_free(c);
  fake_daemon_stop(fake);
  tu_rmtree(dir);
}
END_TEST

START_TEST(bad_attach_timeout_env_is_invalid) {
  char dir[200], sock[256];
  tu_tmpdir(dir, sizeof dir);
  pid_t fake = fake_daemon_start(dir, sock, sizeof sock, FAKE_SILENT_ATTACH);
  setenv("DEEPEPD_ATTACH_TIMEOUT_MS", "soon", 1);
  dep_client_t *c = new_client();
  ck_assert_int_eq(dep_connect(c, sock), 0);
  struct dep_attach_args a = attach_args("job-env", 0);
  ck_assert_int_eq(dep_attach(c, &a), DEP_ERR_INVALID);
  ck_assert_ptr_nonnull(strstr(dep_errmsg(c), "DEEPEPD_ATTACH_TIMEOUT_MS"));
  dep_client_free(c);
  fake_daemon_stop(fake);
  tu_rmtree(dir);
}
END_TEST

/*
 * The SM budget and $DEEPEP_KERNEL_CTAS (cuda_ops.h), without a GPU: the
 * SMs shared out and capped; an override within the residency bound taken;
 * anything else refused with the bounds, and the default kept.
 */
START_TEST(kernel_ctas_override_is_bounded_and_refused_clearly) {
  uint32_t out = 0;
  char why[256] = "";
  ck_assert_int_eq(cuops_sm_budget(132, 1, NULL, &out, why, sizeof why), 0);
  ck_assert_uint_eq(out, CUOPS_MAX_CTAS);
  ck_assert_int_eq(cuops_sm_budget(132, 8, "", &out, why, sizeof why), 0);
  ck_assert_uint_eq(out, 16);
  ck_assert_int_eq(cuops_sm_budget(132, 2, "132", &out, why, sizeof why), 0);
  ck_assert_uint_eq(out, 132);
  ck_assert_int_eq(cuops_sm_budget(132, 1, "264", &out, why, sizeof why), 0); /* 2 per SM */
  ck_assert_uint_eq(out, 264);
  static const char *const bad[] = {"0",    "265",  "-5",  "+5", " 5",
                                    "12x",  "lots", "99999999999999999999"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    out = 7;
    why[0] = '\0';
    ck_assert_int_eq(cuops_sm_budget(132, 1, bad[i], &out, why, sizeof why), DEP_ERR_INVALID);
    ck_assert_msg(strstr(why, "DEEPEP_KERNEL_CTAS") != NULL && strstr(why, "from 1 to 264") != NULL,
                  "%s: said %s", bad[i], why);
    ck_assert_uint_eq(out, CUOPS_MAX_CTAS); /* the default stands */
  }
  /* Eight ranks on the GPU: each may have at most a quarter of its SMs' CTAs. */
  ck_assert_int_eq(cuops_sm_budget(132, 8, "34", &out, why, sizeof why), DEP_ERR_INVALID);
  ck_assert_msg(strstr(why, "from 1 to 33 (132 SMs, 8 ranks") != NULL, "said %s", why);
}
END_TEST

/*
 * The slab's private area (slab.h) holds the cuda library's operation
 * memory (cuops_block_layout), without a GPU: for shapes at the ends of
 * every range and GPUs of 1 to 512 SMs, it comes after the data, aligned,
 * its parts in order inside it; a GPU beyond the bound is refused, not
 * overrun.
 */
START_TEST(the_operations_memory_fits_every_slabs_private_area) {
  static const uint32_t hiddens[] = {128, 7168, 16384}, tokens[] = {1, 128, 4096, 65536};
  static const uint32_t worlds[] = {1, 2, 8, 64, 4096}, topks[] = {1, 8, 16};
  static const int sms[] = {1, 132, 512};
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
            for (size_t si = 0; si < 3; si++) {
              struct cuops_block b;
              ck_assert_msg(cuops_block_layout(&sh, W, &l, sms[si], &b, why, sizeof why) == 0,
                            "hidden %u, %u tokens, world %u, top-%u, %d SMs: %s", sh.hidden, mt,
                            W, sh.topk, sms[si], why);
              ck_assert(b.dev < b.scratch && b.scratch < b.stage && b.stage < b.tcnt &&
                        b.tcnt + b.tcnt_bytes <= b.loop_dev && b.loop_dev < b.loop_slab &&
                        b.loop_slab + l.data_off + 4096 <= b.end && b.end <= l.priv_bytes);
              checked++;
            }
          }
  ck_assert_uint_eq(checked, 3 * 4 * 5 * 3 * 2 * 3);
  struct dep_job_shape sh = {.max_tokens_per_rank = 4096, .hidden = 7168, .num_experts = 256,
                             .topk = 8, .dtype = DEP_DTYPE_BF16};
  struct dep_slab_layout l;
  struct cuops_block b;
  ck_assert_int_eq(dep__slab_layout(&sh, 8, &l, why, sizeof why), 0);
  ck_assert_int_eq(cuops_block_layout(&sh, 8, &l, 1 << 20, &b, why, sizeof why), DEP_ERR_INTERNAL);
  ck_assert_msg(strstr(why, "private area") != NULL, "said %s", why);
}
END_TEST

/*
 * A rank lets go of its slabs before the daemon hears that it leaves (the
 * daemon may then scrub the memory and lend it to another job at once):
 * through dep_detach, and through dep_client_free of an attached handle.
 */
START_TEST(slabs_are_unmapped_before_the_daemon_hears_detach) {
  for (int by_free = 0; by_free <= 1; by_free++) {
    char dir[200], sock[256];
    tu_tmpdir(dir, sizeof dir);
    pid_t fake = fake_daemon_start(dir, sock, sizeof sock, FAKE_ATTACH_UNMAP);
    dep_client_t *c = new_client();
    ck_assert_int_eq(dep_connect(c, sock), 0);
    struct dep_attach_args a = attach_args("job-unmap", 0);
    ck_assert_int_eq(dep_attach(c, &a), DEP_OK);
    if (!by_free)
      ck_assert_int_eq(dep_detach(c), DEP_OK);
    dep_client_free(c);
    ck_assert_msg(fake_daemon_wait(fake) == 0, "DETACH came while the slabs were mapped (%s)",
                  by_free ? "dep_client_free" : "dep_detach");
    tu_rmtree(dir);
  }
}
END_TEST

START_TEST(attach_reply_fds_never_leak) {
  for (int lie = 0; lie <= 1; lie++) {
    char dir[200], sock[256];
    tu_tmpdir(dir, sizeof dir);
    pid_t fake = fake_daemon_start(dir, sock, sizeof sock, lie ? FAKE_ATTACH_FDS_LIE : FAKE_ATTACH_FDS);
    dep_client_t *c = new_client();
    int before = count_open_fds();
    ck_assert_int_eq(dep_connect(c, sock), 0);
    struct dep_attach_args a = attach_args("job-fds", 0);
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
    fake_daemon_stop(fake);
    tu_rmtree(dir);
  }
}
END_TEST

/* ---- a real daemon ---------------------------------------------------------------- */

START_TEST(status_reports_the_daemon) {
  struct tu_daemon d;
  ck_assert_int_eq(tu_daemon_start(&d, NULL), 0);
  dep_client_t *c = new_client();
  ck_assert_msg(dep_connect(c, d.sock) == 0, "%s", dep_errmsg(c));
  struct dep_status *st = NULL;
  ck_assert_msg(dep_status(c, &st) == 0, "%s", dep_errmsg(c));
  ck_assert_uint_eq(st->pid, (uint32_t)d.pid);
  ck_assert_str_eq(st->backend, "host");
  ck_assert_uint_eq(st->proto_version, DEP_PROTO_VERSION);
  ck_assert_str_eq(st->version, DEP_VERSION_STRING);
  ck_assert_uint_ge(st->num_clients, 1);
  ck_assert_uint_eq(st->num_jobs, 0);
  dep_status_free(st);
  dep_client_free(c);
  tu_daemon_stop(&d);
  tu_daemon_cleanup(&d);
}
END_TEST

START_TEST(two_handles_are_independent) {
  struct tu_daemon d;
  ck_assert_int_eq(tu_daemon_start(&d, NULL), 0);
  dep_client_t *a = new_client(), *b = new_client();
  ck_assert_int_eq(dep_connect(a, d.sock), 0);
  ck_assert_int_eq(dep_connect(b, d.sock), 0);
  struct dep_status *st = NULL;
  ck_assert_int_eq(dep_status(a, &st), 0);
  ck_assert_uint_ge(st->num_clients, 2);
  dep_status_free(st);
  /* A failure on one handle leaves the other's message and connection alone. */
  struct dep_attach_args bad = attach_args("job-x", 0);
  bad.shape.topk = 99;
  ck_assert_int_eq(dep_attach(b, &bad), DEP_ERR_INVALID);
  ck_assert_ptr_nonnull(strstr(dep_errmsg(b), "topk"));
  ck_assert_str_eq(dep_errmsg(a), "");
  dep_client_free(b);
  ck_assert_int_eq(dep_status(a, &st), 0);
  ck_assert_uint_eq(st->pid, (uint32_t)d.pid);
  ck_assert_uint_eq(st->num_jobs, 0); /* the invalid attach never reached the daemon */
  dep_status_free(st);
  dep_client_free(a);
  tu_daemon_stop(&d);
  tu_daemon_cleanup(&d);
}
END_TEST

START_TEST(daemon_stop_is_daemon_gone_at_once_and_reconnect_works) {
  struct tu_daemon d;
  ck_assert_int_eq(tu_daemon_start(&d, NULL), 0);
  dep_client_t *c = new_client();
  ck_assert_int_eq(dep_connect(c, d.sock), 0);
  tu_daemon_stop(&d);
  struct dep_status *st = NULL;
  int64_t t0 = now_ms();
  ck_assert_int_eq(dep_status(c, &st), DEP_ERR_DAEMON_GONE);
  ck_assert_int_lt(now_ms() - t0, 1000);
  ck_assert_ptr_nonnull(strstr(dep_errmsg(c), "reconnect with dep_connect"));
  ck_assert_int_eq(dep_status(c, &st), DEP_ERR_STATE);
  /* The same handle connects to a new daemon in the same place. */
  ck_assert_int_eq(tu_daemon_start_in(&d, d.dir, NULL), 0);
  ck_assert_msg(dep_connect(c, d.sock) == 0, "%s", dep_errmsg(c));
  ck_assert_int_eq(dep_status(c, &st), 0);
  ck_assert_uint_eq(st->pid, (uint32_t)d.pid);
  dep_status_free(st);
  dep_client_free(c);
  tu_daemon_stop(&d);
  tu_daemon_cleanup(&d);
}
END_TEST

/* A rank in its own process: attach, report, wait for the word, detach. */
static void rank_main(const char *sock, uint32_t rank, int report, int go) {
  dep_client_t *c = NULL;
  int rc = dep_client_new(&c);
  if (rc == 0)
    rc = dep_connect(c, sock);
  struct dep_attach_args a = attach_args("job-two", rank);
  if (rc == 0)
    rc = dep_attach(c, &a);
  if (rc != 0)
    fprintf(stderr, "rank %u: %s\n", rank, dep_errmsg(c));
  if (write(report, &rc, sizeof rc) != sizeof rc || rc != 0)
    _exit(1);
  char byte;
  if (read(go, &byte, 1) != 1)
    _exit(2);
  rc = dep_detach(c);
  if (rc != 0)
    fprintf(stderr, "rank %u detach: %s\n", rank, dep_errmsg(c));
  if (write(report, &rc, sizeof rc) != sizeof rc)
    _exit(3);
  dep_client_free(c);
  _exit(rc == 0 ? 0 : 4);
}

static int read_report(int fd) {
  struct pollfd p = {.fd = fd, .events = POLLIN};
  ck_assert_int_eq(poll(&p, 1, 20000), 1);
  int rc = -999;
  ck_assert_int_eq(read(fd, &rc, sizeof rc), (ssize_t)sizeof rc);
  return rc;
}

static const struct dep_status_job *find_job(const struct dep_status *st, const char *id) {
  for (uint32_t i = 0; i < st->num_jobs; i++)
    if (strcmp(st->jobs[i].job_id, id) == 0)
      return &st->jobs[i];
  return NULL;
}

/* Balanced braces and brackets outside strings, and a "pid" equal to pid. */
static void check_json(const char *js, pid_t pid) {
  int depth = 0;
  bool in_str = false;
  for (const char *p = js; *p != '\0'; p++) {
    if (in_str) {
      if (*p == '\\')
        p++;
      else if (*p == '"')
        in_str = false;
      continue;
    }
    if (*p == '"')
      in_str = true;
    else if (*p == '{' || *p == '[')
      depth++;
    else if (*p == '}' || *p == ']')
      ck_assert_int_ge(--depth, 0);
  }
  ck_assert_int_eq(depth, 0);
  ck_assert(!in_str);
  static const char *const keys[] = {
      "\"version\":", "\"proto_version\":", "\"uptime_ms\":", "\"backend\":", "\"clients\":",
      "\"devices\":[", "\"jobs\":["};
  for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++)
    ck_assert_msg(strstr(js, keys[i]) != NULL, "missing %s in %s", keys[i], js);
  char want[64];
  snprintf(want, sizeof want, "\"pid\":%d,", (int)pid);
  ck_assert_msg(strstr(js, want) != NULL, "no %s in %s", want, js);
}

START_TEST(two_ranks_attach_show_in_status_and_detach) {
  struct tu_daemon d;
  ck_assert_int_eq(tu_daemon_start(&d, NULL), 0);
  int report[2], go[2];
  ck_assert_int_eq(pipe(report), 0);
  ck_assert_int_eq(pipe(go), 0);
  pid_t kids[2];
  for (uint32_t r = 0; r < 2; r++) {
    kids[r] = fork();
    ck_assert_int_ge(kids[r], 0);
    if (kids[r] == 0)
      rank_main(d.sock, r, report[1], go[0]);
  }
  ck_assert_int_eq(read_report(report[0]), 0);
  ck_assert_int_eq(read_report(report[0]), 0);

  dep_client_t *c = new_client();
  ck_assert_int_eq(dep_connect(c, d.sock), 0);
  struct dep_status *st = NULL;
  ck_assert_int_eq(dep_status(c, &st), 0);
  const struct dep_status_job *j = find_job(st, "job-two");
  ck_assert_ptr_nonnull(j);
  ck_assert_uint_eq(j->ranks_attached, 2);
  ck_assert_uint_eq(j->ranks_expected, 2);
  ck_assert_uint_eq(j->world_size, 2);
  ck_assert_uint_eq(j->owner_uid, (uint32_t)getuid());
  dep_status_free(st);

  /* deepepctl shows the job, as text and as JSON. */
  char *out, *err;
  ck_assert_int_eq(run_ctl((const char *[]){"-s", d.sock, "status", NULL}, &out, &err), 0);
  ck_assert_msg(strstr(out, "job-two") != NULL && strstr(out, "2/2") != NULL, "%s", out);
  free(out);
  free(err);
  ck_assert_int_eq(run_ctl((const char *[]){"-s", d.sock, "--json", "status", NULL}, &out, &err), 0);
  check_json(out, d.pid);
  ck_assert_ptr_nonnull(strstr(out, "\"job_id\":\"job-two\""));
  ck_assert_ptr_nonnull(strstr(out, "\"ranks_attached\":2,\"ranks_expected\":2"));
  free(out);
  free(err);

  ck_assert_int_eq(write(go[1], "gg", 2), 2);
  ck_assert_int_eq(read_report(report[0]), 0);
  ck_assert_int_eq(read_report(report[0]), 0);
  for (int r = 0; r < 2; r++) {
    int ws = 0;
    ck_assert_int_eq(waitpid(kids[r], &ws, 0), kids[r]);
    ck_assert(WIFEXITED(ws) && WEXITSTATUS(ws) == 0);
  }
  ck_assert_int_eq(dep_status(c, &st), 0);
  ck_assert_ptr_null(find_job(st, "job-two"));
  ck_assert_uint_eq(st->num_jobs, 0);
  dep_status_free(st);
  dep_client_free(c);
  tu_daemon_stop(&d);
  tu_daemon_cleanup(&d);
}
END_TEST

/* The fraction of the pages of [p, p + len) that this process's page table maps now. */
static double pages_mapped(const void *p, uint64_t len) {
  int fd = open("/proc/self/pagemap", O_RDONLY);
  ck_assert_int_ge(fd, 0);
  const uint64_t first = (uintptr_t)p / 4096, n = (len + 4095) / 4096;
  uint64_t present = 0;
  for (uint64_t i = 0; i < n; i++) {
    uint64_t e = 0;
    ck_assert_int_eq(pread(fd, &e, sizeof e, (off_t)((first + i) * 8)), (ssize_t)sizeof e);
    present += e >> 63;
  }
  close(fd);
  return (double)present / (double)n;
}

/* Attach a job of one rank on the host backend (kernel_warmup as `warm` says) and
 * return how much of its slab is mapped in before any call; warmup_ms in *ms. */
static double attached_slab_mapped(bool warm, double *ms) {
  struct tu_daemon d;
  ck_assert_int_eq(tu_daemon_start(&d, warm ? "kernel_warmup: true\n" : "kernel_warmup: false\n"),
                   0);
  dep_client_t *c = new_client();
  ck_assert_int_eq(dep_connect(c, d.sock), 0);
  struct dep_attach_args a = attach_args("job-warm", 0);
  a.world_size = a.local_world_size = 1;
  a.shape.hidden = 2048;
  ck_assert_msg(dep_attach(c, &a) == 0, "%s", dep_errmsg(c));
  struct dep_attach_info info = {.size = sizeof info};
  ck_assert_int_eq(dep_attach_info(c, &info), 0);
  struct dep_attach_times t = {.size = sizeof t};
  ck_assert_int_eq(dep_attach_times(c, &t), 0);
  *ms = t.warmup_ms;
  /* What the operations touch: the layout's bytes (the slab is rounded up to chunks). */
  struct dep_slab_layout lay;
  char why[256];
  ck_assert_int_eq(dep__slab_layout(&a.shape, 1, &lay, why, sizeof why), 0);
  ck_assert_uint_ge(info.slab_bytes, lay.total_bytes);
  double f = pages_mapped(info.slabs[0], lay.total_bytes);
  ck_assert_int_eq(dep_detach(c), 0);
  dep_client_free(c);
  tu_daemon_stop(&d);
  tu_daemon_cleanup(&d);
  return f;
}

/* The host backend's warm-up maps every page of the rank's slab in at
 * attach, so that the first call takes no page faults; without it nothing
 * but what the attach itself read is mapped. */
START_TEST(host_warmup_maps_the_slab_in_before_the_first_call) {
  double ms_on = 0, ms_off = 0;
  double on = attached_slab_mapped(true, &ms_on), off = attached_slab_mapped(false, &ms_off);
  printf("host warm-up: %.0f%% of the slab mapped in %.3f ms; without it %.0f%%\n", on * 100,
         ms_on, off * 100);
  ck_assert_msg(on == 1.0, "kernel_warmup: true left %.1f%% of the slab unmapped", (1 - on) * 100);
  ck_assert_msg(ms_on > 0.0, "warmup_ms says nothing of the warm-up");
  ck_assert_msg(off < 0.5, "kernel_warmup: false mapped %.0f%% of the slab anyway", off * 100);
  ck_assert_msg(ms_off == 0.0, "warmup_ms %.3f without a warm-up", ms_off);
}
END_TEST

/* ---- deepepctl ---------------------------------------------------------------------- */

START_TEST(ctl_status_prints_the_daemon) {
  struct tu_daemon d;
  ck_assert_int_eq(tu_daemon_start(&d, NULL), 0);
  char *out, *err, want[64];
  ck_assert_int_eq(run_ctl((const char *[]){"-s", d.sock, "status", NULL}, &out, &err), 0);
  const char *pid = strstr(out, "\npid:");
  ck_assert_msg(pid != NULL, "no pid line in:\n%s", out);
  snprintf(want, sizeof want, "%d\n", (int)d.pid);
  pid += strspn(pid + 5, " ") + 5;
  ck_assert_msg(strncmp(pid, want, strlen(want)) == 0, "pid is not %s in:\n%s", want, out);
  ck_assert_ptr_nonnull(strstr(out, "version:"));
  ck_assert_ptr_nonnull(strstr(out, "uptime:"));
  ck_assert_ptr_nonnull(strstr(out, "backend:  host\n"));
  ck_assert_ptr_nonnull(strstr(out, "devices:"));
  ck_assert_ptr_nonnull(strstr(out, "no jobs"));
  ck_assert_str_eq(err, "");
  free(out);
  free(err);
  /* --json after the command works too, and parses. */
  ck_assert_int_eq(run_ctl((const char *[]){"-s", d.sock, "status", "--json", NULL}, &out, &err), 0);
  check_json(out, d.pid);
  ck_assert_ptr_nonnull(strstr(out, "\"jobs\":[]"));
  free(out);
  free(err);
  tu_daemon_stop(&d);
  tu_daemon_cleanup(&d);
}
END_TEST

/* Exit status of deepepctl with args, output discarded. */
static int ctl_rc(const char *const *args) {
  char *out, *err;
  int rc = run_ctl(args, &out, &err);
  free(out);
  free(err);
  return rc;
}

START_TEST(ctl_usage_errors_exit_2) {
  char *out, *err;
  ck_assert_int_eq(run_ctl((const char *[]){"bogus", NULL}, &out, &err), 2);
  ck_assert_ptr_nonnull(strstr(err, "unknown command \"bogus\""));
  ck_assert_ptr_nonnull(strstr(err, "usage: deepepctl"));
  ck_assert_str_eq(out, "");
  free(out);
  free(err);
  ck_assert_int_eq(ctl_rc((const char *[]){"--frobnicate", "status", NULL}), 2);
  ck_assert_int_eq(ctl_rc((const char *[]){NULL}), 2);
  ck_assert_int_eq(ctl_rc((const char *[]){"-s", NULL}), 2);
  ck_assert_int_eq(ctl_rc((const char *[]){"status", "extra", NULL}), 2);
  ck_assert_int_eq(run_ctl((const char *[]){"--help", NULL}, &out, &err), 0);
  ck_assert_ptr_nonnull(strstr(out, "status"));
  ck_assert_str_eq(err, "");
  free(out);
  free(err);
  ck_assert_int_eq(run_ctl((const char *[]){"version", NULL}, &out, &err), 0);
  ck_assert_ptr_nonnull(strstr(out, DEP_VERSION_STRING));
  free(out);
  free(err);
}
END_TEST

START_TEST(ctl_without_daemon_exits_1_with_no_daemon_message) {
  char *out, *err;
  ck_assert_int_eq(run_ctl((const char *[]){"-s", "/nonexistent", "status", NULL}, &out, &err), 1);
  ck_assert_msg(strstr(err, "deepepctl: deepepd not running: no socket at /nonexistent") != NULL,
                "%s", err);
  ck_assert_ptr_nonnull(strstr(err, "systemctl start deepepd"));
  ck_assert_str_eq(out, "");
  free(out);
  free(err);
}
END_TEST

/* ---- the shared library's ABI ----------------------------------------------------------- */

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
  tcase_add_test(local, shared_library_exports_only_dep_symbols);
  tcase_add_test(local, kernel_ctas_override_is_bounded_and_refused_clearly);
  tcase_add_test(local, the_operations_memory_fits_every_slabs_private_area);
  suite_add_tcase(s, local);

  TCase *fake = tcase_create("fake_daemon");
  tcase_add_test(fake, fake_daemon_violations_are_refused);
  tcase_add_test(fake, refusal_on_accept_reports_the_daemons_reason);
  tcase_add_test(fake, silent_attach_times_out_on_the_client);
  tcase_add_test(fake, bad_attach_timeout_env_is_invalid);
  tcase_add_test(fake, attach_reply_fds_never_leak);
  tcase_add_test(fake, slabs_are_unmapped_before_the_daemon_hears_detach);
  tcase_set_timeout(fake, 30);
  suite_add_tcase(s, fake);

  TCase *real = tcase_create("daemon");
  tcase_add_test(real, status_reports_the_daemon);
  tcase_add_test(real, larger_structs_are_filled_as_far_as_the_library_knows_them);
  tcase_add_test(real, two_handles_are_independent);
  tcase_add_test(real, daemon_stop_is_daemon_gone_at_once_and_reconnect_works);
  tcase_add_test(real, two_ranks_attach_show_in_status_and_detach);
  tcase_add_test(real, host_warmup_maps_the_slab_in_before_the_first_call);
  tcase_set_timeout(real, 60);
  suite_add_tcase(s, real);

  TCase *ctl = tcase_create("deepepctl");
  tcase_add_test(ctl, ctl_status_prints_the_daemon);
  tcase_add_test(ctl, ctl_usage_errors_exit_2);
  tcase_add_test(ctl, ctl_without_daemon_exits_1_with_no_daemon_message);
  tcase_set_timeout(ctl, 60);
  suite_add_tcase(s, ctl);
  return s;
}
