/*
 * check_client_daemon.c — libdeepep-client and deepepctl against a real
 * deepepd, through real processes: status, attach and detach work; a newer
 * caller's larger structs are filled as far as the library knows them; a
 * daemon that goes away is noticed at once, never a hang; deepepctl
 * prints, exits and speaks JSON as its man page says.  Without a daemon,
 * or with a fake one: check_client.c.
 */
#include <check.h>
#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "client_internal.h"
#include "clienttest.h"
#include "cuda_ops.h"
#include "daemonwire.h"
#include "deepep.h"
#include "proto.h"
#include "slab.h"
#include "testutil.h"
#include "warm.h"

/* ---- helpers ------------------------------------------------------------- */

/* A real daemon started in d (extra_yaml as tu_daemon_start takes it) and a
 * client connected to it. */
static dep_client_t *daemon_and_client(struct tu_daemon *d, const char *extra_yaml) {
  ck_assert_int_eq(tu_daemon_start(d, extra_yaml), 0);
  return cl_connect(d->sock);
}

/* Free c, then stop the daemon in d and remove its directory. */
static void daemon_and_client_end(struct tu_daemon *d, dep_client_t *c) {
  dep_client_free(c);
  tu_daemon_stop(d);
  tu_daemon_cleanup(d);
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
  dep_client_t *c = daemon_and_client(&d, NULL);
  struct {
    struct dep_attach_args a;
    uint8_t newer[24];
  } ba = {.a = cl_attach_args("job-sized", 0)};
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
  daemon_and_client_end(&d, c);
}
END_TEST

/* ---- a real daemon ---------------------------------------------------------------- */

START_TEST(status_reports_the_daemon) {
  struct tu_daemon d;
  dep_client_t *c = daemon_and_client(&d, NULL);
  struct dep_status *st = NULL;
  ck_assert_msg(dep_status(c, &st) == 0, "%s", dep_errmsg(c));
  ck_assert_uint_eq(st->pid, (uint32_t)d.pid);
  ck_assert_str_eq(st->backend, "host");
  ck_assert_uint_eq(st->proto_version, DEP_PROTO_VERSION);
  ck_assert_str_eq(st->version, DEP_VERSION_STRING);
  ck_assert_uint_ge(st->num_clients, 1);
  ck_assert_uint_eq(st->num_jobs, 0);
  dep_status_free(st);
  daemon_and_client_end(&d, c);
}
END_TEST

START_TEST(two_handles_are_independent) {
  struct tu_daemon d;
  dep_client_t *a = daemon_and_client(&d, NULL), *b = cl_connect(d.sock);
  struct dep_status *st = NULL;
  ck_assert_int_eq(dep_status(a, &st), 0);
  ck_assert_uint_ge(st->num_clients, 2);
  dep_status_free(st);
  /* A failure on one handle leaves the other's message and connection alone. */
  struct dep_attach_args bad = cl_attach_args("job-x", 0);
  bad.shape.topk = 99;
  ck_assert_int_eq(dep_attach(b, &bad), DEP_ERR_INVALID);
  ck_assert_ptr_nonnull(strstr(dep_errmsg(b), "topk"));
  ck_assert_str_eq(dep_errmsg(a), "");
  dep_client_free(b);
  ck_assert_int_eq(dep_status(a, &st), 0);
  ck_assert_uint_eq(st->pid, (uint32_t)d.pid);
  ck_assert_uint_eq(st->num_jobs, 0); /* the invalid attach never reached the daemon */
  dep_status_free(st);
  daemon_and_client_end(&d, a);
}
END_TEST

START_TEST(daemon_stop_is_daemon_gone_at_once_and_reconnect_works) {
  struct tu_daemon d;
  dep_client_t *c = daemon_and_client(&d, NULL);
  tu_daemon_stop(&d);
  struct dep_status *st = NULL;
  int64_t t0 = dw_now_ms();
  ck_assert_int_eq(dep_status(c, &st), DEP_ERR_DAEMON_GONE);
  ck_assert_int_lt(dw_now_ms() - t0, 1000);
  ck_assert_ptr_nonnull(strstr(dep_errmsg(c), "reconnect with dep_connect"));
  ck_assert_int_eq(dep_status(c, &st), DEP_ERR_STATE);
  /* The same handle connects to a new daemon in the same place. */
  ck_assert_int_eq(tu_daemon_start_in(&d, d.dir, NULL), 0);
  ck_assert_msg(dep_connect(c, d.sock) == 0, "%s", dep_errmsg(c));
  ck_assert_int_eq(dep_status(c, &st), 0);
  ck_assert_uint_eq(st->pid, (uint32_t)d.pid);
  dep_status_free(st);
  daemon_and_client_end(&d, c);
}
END_TEST

/* A rank in its own process: attach, report, wait for the word, detach. */
static void rank_main(const char *sock, uint32_t rank, int report, int go) {
  dep_client_t *c = NULL;
  int rc = dep_client_new(&c);
  if (rc == 0)
    rc = dep_connect(c, sock);
  struct dep_attach_args a = cl_attach_args("job-two", rank);
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

  dep_client_t *c = cl_connect(d.sock);
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
  daemon_and_client_end(&d, c);
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

/* The layout of the one-rank jobs below: what the host calls touch of the slab is its
 * control area and data, [0, priv_off); the private area after it is the cuda library's. */
static struct dep_attach_args warm_job_args(struct dep_slab_layout *lay) {
  struct dep_attach_args a = cl_attach_args("job-warm", 0);
  a.world_size = a.local_world_size = 1;
  a.shape.hidden = 2048;
  char why[256];
  ck_assert_int_eq(dep__slab_layout(&a.shape, 1, lay, why, sizeof why), 0);
  ck_assert_uint_gt(lay->priv_bytes, 0);
  return a;
}

/* Attach a job of one rank on the host backend (kernel_warmup as `warm` says), let
 * dep_attach_times finish the warm-up, and return how much of the slab's touched
 * part is mapped in (of its private area in *priv); warmup_ms in *ms. */
static double attached_slab_mapped(bool warm, double *ms, double *priv) {
  struct tu_daemon d;
  dep_client_t *c =
      daemon_and_client(&d, warm ? "kernel_warmup: true\n" : "kernel_warmup: false\n");
  struct dep_slab_layout lay;
  struct dep_attach_args a = warm_job_args(&lay);
  ck_assert_msg(dep_attach(c, &a) == 0, "%s", dep_errmsg(c));
  struct dep_attach_info info = {.size = sizeof info};
  ck_assert_int_eq(dep_attach_info(c, &info), 0);
  struct dep_attach_times t = {.size = sizeof t};
  ck_assert_int_eq(dep_attach_times(c, &t), 0);
  *ms = t.warmup_ms;
  ck_assert_uint_ge(info.slab_bytes, lay.total_bytes);
  double f = pages_mapped(info.slabs[0], lay.priv_off);
  *priv = pages_mapped((uint8_t *)info.slabs[0] + lay.priv_off, lay.priv_bytes);
  ck_assert_int_eq(dep_detach(c), 0);
  daemon_and_client_end(&d, c);
  return f;
}

/* The host backend's warm-up maps in every page of the rank's slab that its
 * calls touch, and only those: not the private area, which only the cuda
 * library uses.  Without it nothing but what the attach itself read is
 * mapped. */
START_TEST(host_warmup_maps_in_what_the_calls_touch) {
  double ms_on = 0, ms_off = 0, priv_on = 0, priv_off = 0;
  double on = attached_slab_mapped(true, &ms_on, &priv_on);
  double off = attached_slab_mapped(false, &ms_off, &priv_off);
  printf("host warm-up: %.0f%% of the slab's calls' part mapped in %.3f ms (private area "
         "%.0f%%); without it %.0f%%\n", on * 100, ms_on, priv_on * 100, off * 100);
  ck_assert_msg(on == 1.0, "kernel_warmup: true left %.1f%% of the slab unmapped", (1 - on) * 100);
  /* The kernel maps a read fault's neighbours too (fault-around: 64 KiB), so
   * the private area's first pages may be mapped; most of it must not be. */
  ck_assert_msg(priv_on < 0.5, "the warm-up mapped %.0f%% of the private area, which no host "
                "call touches", priv_on * 100);
  ck_assert_msg(ms_on > 0.0, "warmup_ms says nothing of the warm-up");
  ck_assert_msg(off < 0.5, "kernel_warmup: false mapped %.0f%% of the slab anyway", off * 100);
  ck_assert_msg(ms_off == 0.0, "warmup_ms %.3f without a warm-up", ms_off);
}
END_TEST

/* Whether the job leaves the daemon's STATUS within 30 s: it hears of a rank's
 * exit when the connection closes, asynchronously; the bound is a ceiling for a
 * loaded machine, not a measure. */
static bool job_left(dep_client_t *c, const char *id) {
  for (int i = 0; i < 3000; i++) {
    struct dep_status *st = NULL;
    ck_assert_int_eq(dep_status(c, &st), 0);
    const bool there = find_job(st, id) != NULL;
    dep_status_free(st);
    if (!there)
      return true;
    struct timespec ts = {0, 10000000};
    nanosleep(&ts, NULL);
  }
  return false;
}

/* The library's warm-up threads in this process now (by their name, warm.h: a
 * sanitizer's own threads come and go). */
static int warm_threads(void) {
  DIR *d = opendir("/proc/self/task");
  ck_assert_ptr_nonnull(d);
  int n = 0;
  for (struct dirent *e; (e = readdir(d)) != NULL;) {
    if (e->d_name[0] == '.')
      continue;
    char path[300], comm[32] = "";
    snprintf(path, sizeof path, "/proc/self/task/%s/comm", e->d_name);
    FILE *f = fopen(path, "r");
    if (f == NULL)
      continue; /* the thread ended meanwhile */
    if (fgets(comm, sizeof comm, f) != NULL)
      n += strncmp(comm, WARM_THREAD_NAME "\n", sizeof WARM_THREAD_NAME) == 0;
    fclose(f);
  }
  closedir(d);
  return n;
}

/* Whether no warm-up thread is left within 10 s: a joined thread's task may
 * still be listed for a moment after pthread_join returns (the kernel wakes
 * the joiner before it has reaped the thread); one left running would stay. */
static bool no_warm_thread_left(void) {
  for (int i = 0; i < 1000; i++) {
    if (warm_threads() == 0)
      return true;
    struct timespec ts = {0, 10000000};
    nanosleep(&ts, NULL);
  }
  return false;
}

/* A daemon with kernel_warmup, and a client of it whose warm-ups the test's
 * hook holds ($DEEPEP_TEST_WARMUP_HOLD_FD: a pipe the test never writes), so
 * that what follows an attach happens while the warm-up has mapped nothing,
 * with no timing.  A process forked from it inherits the hold. */
static dep_client_t *held_daemon(struct tu_daemon *d, int hold[2]) {
  ck_assert_int_eq(pipe(hold), 0);
  char v[16];
  snprintf(v, sizeof v, "%d", hold[0]);
  setenv("DEEPEP_TEST_WARMUP_HOLD_FD", v, 1);
  return daemon_and_client(d, "kernel_warmup: true\n");
}

/* c attached as the rank of a one-rank job, its warm-up held. */
static void attach_held(dep_client_t *c, struct dep_slab_layout *lay,
                        struct dep_attach_info *info) {
  struct dep_attach_args a = warm_job_args(lay);
  ck_assert(no_warm_thread_left());
  ck_assert_msg(dep_attach(c, &a) == 0, "%s", dep_errmsg(c));
  *info = (struct dep_attach_info){.size = sizeof *info};
  ck_assert_int_eq(dep_attach_info(c, info), 0);
}

static void held_end(struct tu_daemon *d, dep_client_t *c, int hold[2]) {
  daemon_and_client_end(d, c);
  close(hold[0]);
  close(hold[1]);
  unsetenv("DEEPEP_TEST_WARMUP_HOLD_FD");
}

/* dep_attach returns before the warm-up (a thread) has mapped the slab in;
 * the rank's first call finishes it, so that the call runs at steady speed:
 * every page is mapped once it returns, though the thread is still held. */
START_TEST(the_host_warmup_runs_after_the_attach_and_the_first_call_finishes_it) {
  struct tu_daemon d;
  int hold[2];
  struct dep_slab_layout lay;
  struct dep_attach_info info;
  dep_client_t *c = held_daemon(&d, hold);
  attach_held(c, &lay, &info);
  double at_attach = pages_mapped(info.slabs[0], lay.priv_off);
  ck_assert_msg(at_attach < 0.5, "dep_attach returned with %.0f%% of the slab mapped: the "
                "warm-up ran in it", at_attach * 100);
  ck_assert_int_eq(warm_threads(), 1);
  uint64_t call = 0;
  ck_assert_msg(dep_next_call(c, &call) == 0, "%s", dep_errmsg(c));
  double at_call = pages_mapped(info.slabs[0], lay.priv_off);
  ck_assert_msg(at_call == 1.0, "the first call returned with %.1f%% of the slab unmapped",
                (1 - at_call) * 100);
  ck_assert(no_warm_thread_left());
  struct dep_attach_times t = {.size = sizeof t};
  ck_assert_int_eq(dep_attach_times(c, &t), 0);
  ck_assert_msg(t.warmup_ms > 0.0, "warmup_ms says nothing of the warm-up the call finished");
  ck_assert_int_eq(dep_detach(c), 0);
  held_end(&d, c, hold);
}
END_TEST

/* A detach while the warm-up runs stops and joins its thread: none is left
 * in the process, and a second attach of the handle works. */
START_TEST(a_detach_during_the_host_warmup_leaves_no_thread) {
  struct tu_daemon d;
  int hold[2];
  struct dep_slab_layout lay;
  struct dep_attach_info info;
  dep_client_t *c = held_daemon(&d, hold);
  attach_held(c, &lay, &info);
  ck_assert_int_eq(warm_threads(), 1);
  ck_assert_msg(dep_detach(c) == 0, "%s", dep_errmsg(c));
  ck_assert(no_warm_thread_left());
  struct dep_attach_args a = warm_job_args(&lay);
  ck_assert_msg(dep_attach(c, &a) == 0, "%s", dep_errmsg(c));
  ck_assert_int_eq(warm_threads(), 1);
  dep_client_free(c); /* frees while held: joined as well */
  ck_assert(no_warm_thread_left());
  c = cl_connect(d.sock);
  held_end(&d, c, hold);
}
END_TEST

/* A child forked during the warm-up has no warm-up thread: its calls do not
 * wait for its parent's (the child's first call returns), and a rank that
 * exits during the warm-up is gone from the daemon as any other. */
START_TEST(a_fork_or_an_exit_during_the_host_warmup_is_clean) {
  struct tu_daemon d;
  int hold[2];
  struct dep_slab_layout lay;
  struct dep_attach_info info;
  dep_client_t *c = held_daemon(&d, hold);
  /* A rank process that exits with its warm-up held: the daemon lets its job go.  (It
   * is forked first: a process with threads may not start one in a forked child
   * under ThreadSanitizer.) */
  pid_t kid = fork();
  ck_assert_int_ge(kid, 0);
  if (kid == 0) {
    dep_client_t *k = cl_connect(d.sock);
    struct dep_attach_args a = warm_job_args(&lay);
    snprintf(a.job_id, sizeof a.job_id, "job-warm-exit");
    _exit(dep_attach(k, &a) == 0 && warm_threads() == 1 ? 0 : 1);
  }
  int ws = 0;
  ck_assert_int_eq(waitpid(kid, &ws, 0), kid);
  ck_assert_msg(WIFEXITED(ws) && WEXITSTATUS(ws) == 0, "the rank that exited failed to attach "
                "or had no warm-up thread");
  ck_assert_msg(job_left(c, "job-warm-exit"), "the job of the rank that exited stayed");
  /* A child forked while the warm-up runs: its calls do not wait for the parent's. */
  attach_held(c, &lay, &info);
  kid = fork();
  ck_assert_int_ge(kid, 0);
  if (kid == 0) {
    alarm(30); /* a ceiling for a wait on the parent's thread: the test's failure, not a hang */
    struct dep_attach_times t = {.size = sizeof t};
    uint64_t call = 0;
    _exit(dep_attach_times(c, &t) == 0 && dep_next_call(c, &call) == 0 ? 0 : 1);
  }
  ck_assert_int_eq(waitpid(kid, &ws, 0), kid);
  ck_assert_msg(WIFEXITED(ws) && WEXITSTATUS(ws) == 0, "the forked child's calls failed or hung "
                "(status %#x)", ws);
  ck_assert_int_eq(warm_threads(), 1); /* the parent's warm-up is still there */
  ck_assert_int_eq(dep_detach(c), 0);
  ck_assert(no_warm_thread_left());
  held_end(&d, c, hold);
}
END_TEST

/* The test hook is checked like any input: a value that is no open descriptor
 * fails the attach, saying so, before anything goes on the wire. */
START_TEST(a_bad_warmup_hold_fails_the_attach) {
  struct tu_daemon d;
  dep_client_t *c = daemon_and_client(&d, "kernel_warmup: true\n");
  struct dep_slab_layout lay;
  struct dep_attach_args a = warm_job_args(&lay);
  const char *bad[] = {"x", "-1", "12x", "65536", "999"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    setenv("DEEPEP_TEST_WARMUP_HOLD_FD", bad[i], 1);
    ck_assert_int_eq(dep_attach(c, &a), DEP_ERR_INVALID);
    ck_assert_msg(strstr(dep_errmsg(c), "DEEPEP_TEST_WARMUP_HOLD_FD") != NULL, "%s: %s", bad[i],
                  dep_errmsg(c));
  }
  unsetenv("DEEPEP_TEST_WARMUP_HOLD_FD");
  ck_assert_msg(dep_attach(c, &a) == 0, "%s", dep_errmsg(c));
  ck_assert_int_eq(dep_detach(c), 0);
  daemon_and_client_end(&d, c);
}
END_TEST

/*
 * The warm-up's list holds every region a rank of a full node lists, and a
 * list that would overrun it (more slabs mapped than a node has ranks) is
 * DEP_ERR_INTERNAL rather than regions dropped.  The local ranks are every
 * other rank of the world, in slabs apart, so that no two regions join:
 * the most warm_regions can list.  (The old list dropped what did not fit,
 * the exchange region first, and said nothing.)
 */
START_TEST(the_warm_up_lists_a_full_node_and_refuses_more) {
  enum { WORLD = 2 * DEP_MAX_LOCAL_RANKS + 2 };
  const uint64_t block = 8192, data_off = 4096, parity = WORLD * block;
  const uint64_t span = data_off + 2 * parity;
  const size_t bytes = (WORLD + 1) * span;
  uint8_t *base = mmap(NULL, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  ck_assert_ptr_ne(base, MAP_FAILED);
  uint8_t *slabs[WORLD] = {NULL};
  struct dep_client *c = calloc(1, sizeof *c);
  ck_assert_ptr_nonnull(c);
  c->ops.lay = (struct dep_slab_layout){.block_bytes = block, .data_off = data_off,
                                        .parity_bytes = parity, .xchg_bytes = 4096};
  c->ops.world = WORLD;
  c->ops.rank = 1;
  c->ops.slabs = slabs;
  c->ops.xchg = base + WORLD * span;
  for (uint32_t r = 1; r < WORLD; r += 2)
    slabs[r] = base + r * span; /* DEP_MAX_LOCAL_RANKS + 1 of them */
  ck_assert_int_eq(warm_regions(c), DEP_ERR_INTERNAL);
  ck_assert_msg(strstr(c->errmsg, "this is a bug") != NULL, "%s", c->errmsg);
  ck_assert_uint_eq(c->warm.n, 0);

  slabs[WORLD - 1] = NULL; /* a full node: DEP_MAX_LOCAL_RANKS slabs */
  ck_assert_int_eq(warm_regions(c), 0);
  ck_assert_uint_eq(c->warm.n, WARM_MAX_REGIONS);
  ck_assert_uint_eq(c->warm.n, 5 * DEP_MAX_LOCAL_RANKS - 1);
  ck_assert_ptr_eq(c->warm.r[0].p, slabs[1]);
  ck_assert_ptr_eq(c->warm.r[c->warm.n - 1].p, c->ops.xchg);
  free(c);
  munmap(base, bytes);
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

Suite *client_daemon_suite(void);
Suite *client_daemon_suite(void) {
  Suite *s = suite_create("client_daemon");
  TCase *real = tcase_create("daemon");
  tcase_add_test(real, status_reports_the_daemon);
  tcase_add_test(real, larger_structs_are_filled_as_far_as_the_library_knows_them);
  tcase_add_test(real, two_handles_are_independent);
  tcase_add_test(real, daemon_stop_is_daemon_gone_at_once_and_reconnect_works);
  tcase_add_test(real, two_ranks_attach_show_in_status_and_detach);
  tcase_add_test(real, host_warmup_maps_in_what_the_calls_touch);
  tcase_add_test(real, the_host_warmup_runs_after_the_attach_and_the_first_call_finishes_it);
  tcase_add_test(real, a_detach_during_the_host_warmup_leaves_no_thread);
  tcase_add_test(real, a_fork_or_an_exit_during_the_host_warmup_is_clean);
  tcase_add_test(real, a_bad_warmup_hold_fails_the_attach);
  tcase_set_timeout(real, 60);
  suite_add_tcase(s, real);

  TCase *warm = tcase_create("warm-up");
  tcase_add_test(warm, the_warm_up_lists_a_full_node_and_refuses_more);
  suite_add_tcase(s, warm);

  TCase *ctl = tcase_create("deepepctl");
  tcase_add_test(ctl, ctl_status_prints_the_daemon);
  tcase_add_test(ctl, ctl_usage_errors_exit_2);
  tcase_add_test(ctl, ctl_without_daemon_exits_1_with_no_daemon_message);
  tcase_set_timeout(ctl, 60);
  suite_add_tcase(s, ctl);
  return s;
}
