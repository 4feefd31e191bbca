/*
 * check_doctor.c — `deepepctl doctor`'s GPU checks (client/ctl_doctor*.c):
 * kernels, the allocation check's compute mode and MPS, and the memory
 * check (check_stats.c holds its host-backend tests: connections, the
 * pools, balance).
 *
 * "decisions" (every machine, CI): what doctor concludes from what a GPU
 * and the daemon told it (ctl_doctor_judge.c), fed the very values a GPU
 * gives, several of which cannot be had for real on the GPU machine: a
 * compute mode of exclusive-process or prohibited (setting one needs root
 * and an idle GPU, and DEVICE.md keeps the shared GPU's settings as they
 * are), a GPU whose architecture the fatbin has no code for, a daemon
 * lending another build's compile, and MPS running or not running — each
 * simulated here, and only here.
 *
 * "gpu" (tagged gpu: make check-gpu; elsewhere each test skips saying why),
 * against a real deepepd on the cuda backend, nothing simulated:
 *   - a healthy node: every check OK and exit 0, and the compute mode and
 *     MPS doctor reports are the ones this test reads from the GPU itself;
 *   - ranks of one job in two processes on one GPU: WARN without MPS, OK
 *     with it (whichever the machine runs: the other is a part skipped,
 *     saying so, and held by the decisions' tests);
 *   - the GPU's memory: a child process takes nearly all of it
 *     (cuMemAlloc); a pool with room left to make WARNs, and a pool that
 *     unmade the largest job's arena for a smaller job FAILs; once the
 *     child frees it, OK again;
 *   - the kernels check with a PTX-only library (DEP_PTX_BUILD names the
 *     build directory of one, make BUILD=... PTX_ONLY=90; without it the
 *     test skips saying so): OK with its own daemon's cached compile, WARN
 *     against a daemon of a SASS build (it lends nothing: each trainer
 *     would compile the PTX itself), and a kernel_cache_dir others may
 *     write: that daemon refuses to start, and doctor FAILs.
 */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "clienttest.h"
#include "ctl_doctor.h"
#include "cudadrv.h"
#include "cudaranks.h"
#include "daemonwire.h"
#include "deepep.h"
#include "proto.h"
#include "slab.h"
#include "testutil.h"
#include "uuid.h"

#define GIB (1024ull * 1024 * 1024)
#define MIB (1024ull * 1024)

static void dg_fresh(struct doctor_check *k, const char *name) {
  memset(k, 0, sizeof *k);
  k->name = name;
}

#define DG_HAS(k, what) \
  ck_assert_msg(strstr((k)->detail, what) != NULL, "\"%s\" not in: %s", what, (k)->detail)
#define DG_DOES(k, what) \
  ck_assert_msg(strstr((k)->action, what) != NULL, "\"%s\" not in: %s", what, (k)->action)

/* A fresh check of doctor's, judged from these inputs: its result. */
static enum doctor_result dg_kernels(struct doctor_check *k, const struct doctor_kernels_in *in) {
  dg_fresh(k, "kernels");
  doctor_judge_kernels(k, in);
  return k->result;
}
static enum doctor_result dg_mode(struct doctor_check *k, const char *gpu, int mode, bool mps,
                                  const char *shared_job) {
  dg_fresh(k, "allocation");
  doctor_judge_mode(k, gpu, mode, mps, shared_job);
  return k->result;
}
static enum doctor_result dg_memory(struct doctor_check *k, const struct doctor_memory_in *in) {
  dg_fresh(k, "memory");
  doctor_judge_memory(k, in);
  return k->result;
}

/* ---- decisions: kernels ------------------------------------------------------------------ */

#define BUILD_A "aaaaaaaaaaaaaaaa1111111111111111aaaaaaaaaaaaaaaa1111111111111111"
#define BUILD_B "bbbbbbbbbbbbbbbb2222222222222222bbbbbbbbbbbbbbbb2222222222222222"

START_TEST(kernels_pass_with_sass_and_fail_with_no_code_for_the_gpu) {
  struct doctor_check k;
  ck_assert(!doctor_kernels_ask(KIMAGE_SASS));
  ck_assert(!doctor_kernels_ask(KIMAGE_NONE));
  ck_assert(doctor_kernels_ask(KIMAGE_PTX_ONLY));
  ck_assert(doctor_kernels_ask(KIMAGE_UNKNOWN));
  struct doctor_kernels_in in = {.gpu = "GPU-1", .arch = 90, .fit = KIMAGE_SASS, .build = BUILD_A};
  ck_assert_int_eq(dg_kernels(&k, &in), DOCTOR_OK);
  DG_HAS(&k, "GPU GPU-1 (sm_90): SASS for it in the fatbin");
  ck_assert_str_eq(k.action, "");
  /* A GPU newer than every SASS and older than every PTX of the build (simulated: sm_120). */
  in = (struct doctor_kernels_in){.gpu = "GPU-2", .arch = 120, .fit = KIMAGE_NONE,
                                  .build = BUILD_A};
  doctor_judge_kernels(&k, &in);
  ck_assert_int_eq(k.result, DOCTOR_FAIL);
  DG_HAS(&k, "GPU GPU-2 (sm_120): the library's kernels have no code for it");
  DG_DOES(&k, "rebuild with sm_120 in NVCC_GENCODE");
}
END_TEST

START_TEST(kernels_with_ptx_only_need_the_daemon_s_compile_of_this_build) {
  struct dep_msg_kernels_ok lent = {.arch = 90, .driver = 13000, .build = BUILD_A, .bytes = 281344};
  /* The daemon lends a compile of this very build: OK. */
  struct doctor_check k;
  struct doctor_kernels_in in = {.gpu = "GPU-1", .arch = 90, .fit = KIMAGE_PTX_ONLY,
                                 .build = BUILD_A, .lend_rc = 0, .lend_why = "", .lent = &lent};
  ck_assert_int_eq(dg_kernels(&k, &in), DOCTOR_OK);
  DG_HAS(&k, "the daemon lends its cached compile of it (281344 bytes, driver 13000)");
  /* Another build's compile: this library's trainers compile for themselves. */
  in.build = BUILD_B;
  ck_assert_int_eq(dg_kernels(&k, &in), DOCTOR_WARN);
  DG_HAS(&k, "lends a compile of build aaaaaaaaaaaaaaaa, not this library's bbbbbbbbbbbbbbbb");
  DG_DOES(&k, "from one build");
  /* No compile at all (a daemon of a SASS build): WARN. */
  in = (struct doctor_kernels_in){.gpu = "GPU-1", .arch = 90, .fit = KIMAGE_PTX_ONLY,
                                  .build = BUILD_A, .lend_rc = DEP_ERR_NOT_FOUND,
                                  .lend_why = "deepepd has no kernels to lend for this GPU"};
  ck_assert_int_eq(dg_kernels(&k, &in), DOCTOR_WARN);
  DG_HAS(&k, "each trainer process compiles it at its start");
  DG_DOES(&k, "install deepepd and libdeepep-client from one build");
  /* A fatbin the parser does not read and no compile: the driver decides, nothing to say. */
  in.fit = KIMAGE_UNKNOWN;
  ck_assert_int_eq(dg_kernels(&k, &in), DOCTOR_OK);
  /* A daemon that did not answer: WARN, pointing at its log. */
  in = (struct doctor_kernels_in){.gpu = "GPU-1", .arch = 90, .fit = KIMAGE_PTX_ONLY,
                                  .build = BUILD_A, .lend_rc = DEP_ERR_PROTOCOL,
                                  .lend_why = "a malformed KERNELS_OK"};
  ck_assert_int_eq(dg_kernels(&k, &in), DOCTOR_WARN);
  DG_HAS(&k, "did not say what it has for it (a malformed KERNELS_OK)");
  DG_DOES(&k, "daemon's log");
}
END_TEST

/* ---- decisions: compute mode and MPS ----------------------------------------------------- */

START_TEST(compute_modes_other_than_default_fail) {
  struct doctor_check k;
  ck_assert_int_eq(dg_mode(&k, "GPU-1", DOCTOR_MODE_DEFAULT, false, NULL), DOCTOR_OK);
  ck_assert_str_eq(k.detail, "GPU GPU-1: compute mode default, MPS not running");
  dg_fresh(&k, "allocation");
  doctor_judge_mode(&k, "GPU-1", DOCTOR_MODE_DEFAULT, true, NULL);
  ck_assert_str_eq(k.detail, "GPU GPU-1: compute mode default, MPS running");
  /* Simulated: the GPU machine's compute mode is not ours to set. */
  for (int mps = 0; mps <= 1; mps++) {
    dg_fresh(&k, "allocation");
    doctor_judge_mode(&k, "GPU-1", DOCTOR_MODE_EXCLUSIVE_PROCESS, mps, NULL);
    ck_assert_int_eq(k.result, DOCTOR_FAIL);
    DG_HAS(&k, "compute mode exclusive-process");
    DG_HAS(&k, "deepepd holds one of its own");
    DG_DOES(&k, "nvidia-smi -i GPU-1 -c DEFAULT");
  }
  ck_assert_int_eq(dg_mode(&k, "GPU-1", DOCTOR_MODE_PROHIBITED, false, NULL), DOCTOR_FAIL);
  DG_HAS(&k, "compute mode prohibited");
  DG_DOES(&k, "nvidia-smi -i GPU-1 -c DEFAULT");
}
END_TEST

START_TEST(ranks_sharing_a_gpu_in_several_processes_want_mps) {
  struct doctor_check k;
  ck_assert_int_eq(dg_mode(&k, "GPU-1", DOCTOR_MODE_DEFAULT, false, "job-a"), DOCTOR_WARN);
  DG_HAS(&k, "ranks of job job-a in several processes share GPU GPU-1 without MPS");
  DG_DOES(&k, "nvidia-cuda-mps-control -d");
  ck_assert_int_eq(dg_mode(&k, "GPU-1", DOCTOR_MODE_DEFAULT, true, "job-a"), DOCTOR_OK);
  DG_HAS(&k, "share GPU GPU-1 through MPS");
  ck_assert_str_eq(k.action, "");
}
END_TEST

START_TEST(a_gpu_is_shared_by_ranks_of_one_job_in_different_processes) {
  struct dep_msg_client cl[3];
  memset(cl, 0, sizeof cl);
  const uint8_t g1[16] = {1}, g2[16] = {2};
  for (int i = 0; i < 3; i++) {
    snprintf(cl[i].job_id, sizeof cl[i].job_id, "job-a");
    cl[i].pid = 100;
    memcpy(cl[i].device_uuid, g1, 16);
  }
  struct dep_msg_clients m = {.n = 3, .clients = cl};
  char job[DEP_JOB_ID_MAX] = "";
  /* Ranks as threads of one process (one pid): no MPS needed. */
  ck_assert(!doctor_shared_gpu(&m, g1, job));
  /* Another process of the same job on the GPU: shared. */
  cl[2].pid = 101;
  ck_assert(doctor_shared_gpu(&m, g1, job));
  ck_assert_str_eq(job, "job-a");
  ck_assert(!doctor_shared_gpu(&m, g2, job));
  /* On another GPU, or of another job, or no rank at all: not shared. */
  memcpy(cl[2].device_uuid, g2, 16);
  ck_assert(!doctor_shared_gpu(&m, g1, job));
  memcpy(cl[2].device_uuid, g1, 16);
  snprintf(cl[2].job_id, sizeof cl[2].job_id, "job-b");
  ck_assert(!doctor_shared_gpu(&m, g1, job));
  cl[2].job_id[0] = '\0';
  cl[0].job_id[0] = '\0';
  cl[0].pid = 102;
  ck_assert(!doctor_shared_gpu(&m, g1, job));
}
END_TEST

/* ---- decisions: memory ------------------------------------------------------------------- */

/* ---- decisions: TCP's restart after idle ---------------------------------------------- */

START_TEST(tcp_slow_start_after_idle_warns_only_where_peers_run_over_tcp) {
  struct doctor_check k;
  dg_fresh(&k, "connections");
  doctor_judge_tcp_idle(&k, 1, 0); /* no TCP peer: nothing to judge */
  ck_assert_int_eq(k.result, DOCTOR_SKIP);
  doctor_judge_tcp_idle(&k, 0, 2);
  ck_assert_int_eq(k.result, DOCTOR_OK);
  DG_HAS(&k, "tcp_slow_start_after_idle 0: the data connections to the 2 TCP peer(s) keep");
  dg_fresh(&k, "connections");
  doctor_judge_tcp_idle(&k, -1, 2); /* unreadable: said, not judged */
  ck_assert_int_eq(k.result, DOCTOR_OK);
  DG_HAS(&k, "unreadable here");
  dg_fresh(&k, "connections");
  doctor_judge_tcp_idle(&k, 1, 3);
  ck_assert_int_eq(k.result, DOCTOR_WARN);
  DG_HAS(&k, "net.ipv4.tcp_slow_start_after_idle 1 with 3 peer(s) over TCP");
  DG_DOES(&k, "sysctl -w net.ipv4.tcp_slow_start_after_idle=0 on every node");
}
END_TEST

START_TEST(memory_judges_the_pool_s_rest_and_the_largest_job_against_free_memory) {
  struct doctor_check k;
  /* The rest of the budget fits: OK. */
  struct doctor_memory_in in = {.gpu = "GPU-1", .budget = 8 * GIB, .made = 2 * GIB,
                                .busy = 0, .free_b = 6 * GIB, .total_b = 140 * GIB};
  ck_assert_int_eq(dg_memory(&k, &in), DOCTOR_OK);
  DG_HAS(&k, "GPU GPU-1: 6.00 of 140.00 GiB free; its pool has made 2.00 of its 8.00 GiB");
  /* A byte short, no job seen: WARN. */
  in.free_b = 6 * GIB - 1;
  ck_assert_int_eq(dg_memory(&k, &in), DOCTOR_WARN);
  DG_HAS(&k, "its pool may still make 6.00 GiB of its 8.00 GiB budget, but the GPU has only");
  DG_DOES(&k, "preallocation: true");
  /* The largest job seen (5 GiB) fits what is made and unlent (2) and free (3): WARN. */
  in = (struct doctor_memory_in){.gpu = "GPU-1", .budget = 8 * GIB, .made = 2 * GIB, .busy = 0,
                                 .free_b = 3 * GIB, .total_b = 140 * GIB, .largest = 5 * GIB,
                                 .largest_job = "big"};
  ck_assert_int_eq(dg_memory(&k, &in), DOCTOR_WARN);
  DG_HAS(&k, "(the largest job seen here still fits)");
  /* A byte more than that: FAIL. */
  in.largest = 5 * GIB + 1;
  ck_assert_int_eq(dg_memory(&k, &in), DOCTOR_FAIL);
  DG_HAS(&k, "job big, the largest seen here, took 5.00 GiB, but the pool holds only 2.00 GiB "
         "made and unlent and the GPU has 3.00 GiB free: a job that size cannot attach");
  /* What is lent to running jobs is not spare. */
  in.largest = 4 * GIB;
  in.busy = 2 * GIB;
  ck_assert_int_eq(dg_memory(&k, &in), DOCTOR_FAIL);
  /* The largest job running has its arena: it need not attach again. */
  in.largest_running = true;
  ck_assert_int_eq(dg_memory(&k, &in), DOCTOR_WARN);
  DG_HAS(&k, "(the largest job seen here runs now, its arena made)");
}
END_TEST

/* ---- gpu: the pieces --------------------------------------------------------------------- */

/* Run bin (deepepctl) with args, its stdout into *out (malloc'd); its exit status. */
static int dg_ctl(const char *bin, const char *dir, char **out, const char *const *args) {
  return dw_run_ctl(bin, dir, out, args);
}

/* `deepepctl --json doctor` of build dir bin_dir (NULL: this build's), printed for the log. */
static int dg_doctor(const char *bin_dir, const struct tu_daemon *d, const char *what,
                     char **out) {
  char bin[600];
  if (bin_dir != NULL)
    dw_sfmt(bin, sizeof bin, "%s/deepepctl", bin_dir);
  else
    dw_sfmt(bin, sizeof bin, "%s", tu_bin("deepepctl"));
  int rc = dg_ctl(bin, d->dir, out, DW_ARGS("-s", d->sock, "--json", "doctor"));
  printf("doctor, %s (exit %d): %s\n", what, rc, *out);
  fflush(stdout);
  return rc;
}

static bool dg_says(const char *out, const char *check, const char *result) {
  char want[160];
  dw_sfmt(want, sizeof want, "{\"check\":\"%s\",\"result\":\"%s\"", check, result);
  return strstr(out, want) != NULL;
}
#define DG_SAYS(out, check, result) \
  ck_assert_msg(dg_says(out, check, result), "%s is not %s: %s", check, result, out)
#define DG_IN(out, what) ck_assert_msg(strstr(out, what) != NULL, "\"%s\" not in: %s", what, out)

/* The processes below (dw_child) hold a CUDA context, or memory, until told to go; each
 * reports on rep. */

/* In the child: say msg, wait for the parent's word (or its end), exit with code. */
static void dg_child_report(const struct dw_child *p, const char *msg) {
  ssize_t n = write(p->rep, msg, strlen(msg));
  (void)n;
}
static void dg_child_wait(const struct dw_child *p) {
  char c;
  ssize_t n = read(p->go, &c, 1);
  (void)n;
}

/* In the parent: what the child reported ("ok..." or why), asserted to begin with "ok". */
static void dg_reported(struct dw_child *p, const char *what, char *msg, size_t len) {
  ssize_t n = read(p->rep, msg, len - 1);
  msg[n > 0 ? n : 0] = '\0';
  ck_assert_msg(n > 0 && strncmp(msg, "ok", 2) == 0, "%s (pid %d): %s", what, (int)p->pid,
                n > 0 ? msg : "exited before reporting");
}

static void dg_finish(struct dw_child *p, const char *what) {
  ck_assert_int_eq(write(p->go, "g", 1), 1);
  int st = 0;
  ck_assert_int_eq(waitpid(p->pid, &st, 0), p->pid);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "%s (pid %d): status 0x%x", what,
                (int)p->pid, st);
  close(p->rep);
  close(p->go);
}

/* A rank process: attach rank `rank` of `W` (all local) of job on GPU uuid, hold until told. */
static void dg_rank(struct dw_child *p, const char *sock, const char *job, uint32_t rank,
                    uint32_t W, const struct dep_job_shape *sh, const uint8_t uuid[16]) {
  dw_child_fork(p);
  if (p->pid != 0)
    return;
  char msg[512];
  struct dep_attach_args a = {.size = sizeof a, .rank = rank, .world_size = W, .local_rank = rank,
                              .local_world_size = W, .shape = *sh};
  snprintf(a.job_id, sizeof a.job_id, "%s", job);
  memcpy(a.device_uuid, uuid, 16);
  dep_client_t *c = NULL;
  if (dep_client_new(&c) != 0 || dep_connect(c, sock) != 0 || dep_attach(c, &a) != 0) {
    snprintf(msg, sizeof msg, "rank %u of %s: %s", rank, job, c ? dep_errmsg(c) : "no client");
    dg_child_report(p, msg);
    _exit(1);
  }
  dg_child_report(p, "ok");
  dg_child_wait(p);
  int rc = dep_detach(c);
  dep_client_free(c);
  _exit(rc == 0 ? 0 : 2);
}

/*
 * In a child: outside MPS (as the daemon), with the primary context of GPU uuid current: the
 * driver, or NULL with why (the driver's load, no such GPU, or the context's CUDA error).
 */
static const struct cudadrv *dg_outside_mps_on(const uint8_t uuid[16], char *why, size_t len) {
  unsetenv("CUDA_MPS_PIPE_DIRECTORY");
  unsetenv("CUDA_MPS_LOG_DIRECTORY");
  const struct cudadrv *cu = cudadrv_load(why, len);
  if (cu == NULL)
    return NULL;
  CUdevice dev;
  CUcontext ctx;
  CUresult r = CUDA_SUCCESS;
  if (cudadrv_device_by_uuid(cu, uuid, &dev) != 0) {
    snprintf(why, len, "no GPU of that UUID visible");
    return NULL;
  }
  if ((r = cu->cuDevicePrimaryCtxRetain(&ctx, dev)) != CUDA_SUCCESS ||
      (r = cu->cuCtxSetCurrent(ctx)) != CUDA_SUCCESS) {
    snprintf(why, len, "%s", cudadrv_errstr(r));
    return NULL;
  }
  return cu;
}

/*
 * A process outside MPS (as the daemon) that takes GPU uuid's memory with cuMemAlloc until
 * no more than `leave` bytes are free, and holds it until told (its exit frees it).
 */
static void dg_hog(struct dw_child *p, const uint8_t uuid[16], uint64_t leave) {
  dw_child_fork(p);
  if (p->pid != 0)
    return;
  char msg[512], why[256] = "";
  const struct cudadrv *cu = dg_outside_mps_on(uuid, why, sizeof why);
  if (cu == NULL) {
    snprintf(msg, sizeof msg, "hog: %s", why);
    dg_child_report(p, msg);
    _exit(1);
  }
  CUresult r = CUDA_SUCCESS;
  size_t free_b = 0, total_b = 0, chunk = 4 * GIB;
  uint64_t taken = 0;
  for (int i = 0; i < 4096; i++) {
    if ((r = cu->cuMemGetInfo(&free_b, &total_b)) != CUDA_SUCCESS)
      break;
    if (free_b <= leave + 16 * MIB)
      break;
    size_t want = free_b - leave < chunk ? free_b - leave : chunk;
    CUdeviceptr ptr;
    if ((r = cu->cuMemAlloc(&ptr, want)) == CUDA_SUCCESS) {
      taken += want;
      continue;
    }
    if (chunk <= 16 * MIB)
      break;
    chunk /= 2; /* fragmented, or a reserve the driver keeps: smaller pieces */
  }
  if (free_b > leave + 16 * MIB) {
    snprintf(msg, sizeof msg, "hog: took %.2f GiB but %.2f GiB are still free (%s)",
             (double)taken / GIB, (double)free_b / GIB, cudadrv_errstr(r));
    dg_child_report(p, msg);
    _exit(1);
  }
  snprintf(msg, sizeof msg, "ok: took %.2f GiB of %.2f, %.2f GiB left free", (double)taken / GIB,
           (double)total_b / GIB, (double)free_b / GIB);
  dg_child_report(p, msg);
  dg_child_wait(p);
  _exit(0); /* the process's end frees it all */
}

/* What the GPU says in a child with this test's environment (as doctor): mode * 2 + mps. */
static int dg_mode_mps(const uint8_t uuid[16]) {
  fflush(NULL);
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) {
    const struct cudadrv *cu = cudadrv_load(NULL, 0);
    CUdevice dev;
    int mode = 0, mps = 0;
    if (cu == NULL || cudadrv_device_by_uuid(cu, uuid, &dev) != 0 ||
        cu->cuDeviceGetAttribute(&mode, CU_DEVICE_ATTRIBUTE_COMPUTE_MODE, dev) != CUDA_SUCCESS)
      _exit(100);
    if (cu->cuDeviceGetAttribute(&mps, CU_DEVICE_ATTRIBUTE_MPS_ENABLED, dev) != CUDA_SUCCESS)
      mps = 0;
    _exit(mode * 2 + (mps != 0));
  }
  int st = 0;
  ck_assert_int_eq(waitpid(pid, &st, 0), pid);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) < 100, "could not read the GPU's compute mode");
  return WEXITSTATUS(st);
}

/* Wait (in a child, up to 10 s) until GPU uuid has `bytes` free: a process's memory is the
 * driver's to release after it exits. */
static void dg_wait_free(const uint8_t uuid[16], uint64_t bytes) {
  fflush(NULL);
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) {
    char why[256];
    const struct cudadrv *cu = dg_outside_mps_on(uuid, why, sizeof why);
    if (cu == NULL)
      _exit(2);
    for (int i = 0; i < 100; i++) {
      size_t free_b = 0, total_b = 0;
      if (cu->cuMemGetInfo(&free_b, &total_b) == CUDA_SUCCESS && free_b >= bytes)
        _exit(0);
      usleep(100 * 1000);
    }
    _exit(1);
  }
  int st = 0;
  ck_assert_int_eq(waitpid(pid, &st, 0), pid);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0,
                "GPU memory was not given back within 10 s of the hog's end (status 0x%x)", st);
}

/* A hog on GPU uuid that leaves `leave` bytes free, once it says how much it took. */
static void dg_hog_start(struct dw_child *hog, const uint8_t uuid[16], uint64_t leave) {
  char msg[512];
  dg_hog(hog, uuid, leave);
  dg_reported(hog, "hog", msg, sizeof msg);
  printf("memory hog: %s\n", msg);
}

/* The hog's end, and its memory back (8 GiB free again). */
static void dg_hog_end(struct dw_child *hog, const uint8_t uuid[16]) {
  dg_finish(hog, "hog");
  dg_wait_free(uuid, 8 * GIB);
}

/* The daemon runs no job, and holds nothing for exited ranks: it looks for
 * them once a second (lend.c), so memory an exited rank held counts as held
 * by a gone process until then, which the allocation check sees. */
static void dg_no_jobs(const struct tu_daemon *d) {
  dep_client_t *c = cl_connect(d->sock);
  uint32_t jobs = 1;
  uint64_t held = 1;
  for (int i = 0; i < 500 && (jobs > 0 || held > 0); i++) {
    struct dep_status *st = NULL;
    ck_assert_int_eq(dep_status(c, &st), 0);
    jobs = st->num_jobs;
    held = 0;
    for (uint32_t k = 0; k < st->num_devices; k++)
      held += st->devices[k].pool_held_bytes;
    dep_status_free(st);
    if (jobs > 0 || held > 0)
      dw_sleep_ms(20);
  }
  dep_client_free(c);
  ck_assert_msg(jobs == 0, "the daemon still runs %u jobs", jobs);
  ck_assert_msg(held == 0, "the daemon still holds %llu bytes for exited ranks",
                (unsigned long long)held);
}

static void dg_start(struct tu_daemon *d, const char *yaml) {
  memset(d, 0, sizeof *d);
  ck_assert_int_eq(tu_daemon_start(d, yaml), 0);
  /* The mode a node's socket has (the tests' daemons make theirs 0666 for other uids). */
  ck_assert_int_eq(chmod(d->sock, 0660), 0);
}

/* A GPU test's start: skip (saying why) without a GPU, else a daemon started with yaml and the
 * first GPU's UUID as a string in gpu. */
static bool dg_gpu_start(const char *test, struct tu_gpus *g, struct tu_daemon *d,
                         const char *yaml, char gpu[DEP_UUID_STR_LEN]) {
  if (!cr_gpu_probe(test, g))
    return false;
  dg_start(d, yaml);
  dep__uuid_str(g->uuid[0], gpu);
  return true;
}

static const struct dep_job_shape dg_small = {.max_tokens_per_rank = 128, .hidden = 1024,
                                              .num_experts = 8, .topk = 2,
                                              .dtype = DEP_DTYPE_BF16};

/* ---- gpu: a healthy node, compute mode and MPS -------------------------------------------- */

START_TEST(doctor_passes_a_healthy_gpu_node_and_reports_its_real_compute_mode) {
  struct tu_gpus g;
  struct tu_daemon d;
  char gpu[DEP_UUID_STR_LEN];
  if (!dg_gpu_start(__func__, &g, &d, NULL, gpu))
    return;
  const int mm = dg_mode_mps(g.uuid[0]);
  /* What doctor must say of the mode and MPS the GPU has, read here and judged alike. */
  struct doctor_check want;
  dg_fresh(&want, "allocation");
  doctor_judge_mode(&want, gpu, mm / 2, mm % 2, NULL);
  printf("GPU %s: compute mode %d, MPS %s\n", gpu, mm / 2, mm % 2 ? "running" : "not running");
  char *out = NULL;
  int rc = dg_doctor(NULL, &d, "a healthy cuda node", &out);
  DG_IN(out, want.detail);
  if (mm / 2 != DOCTOR_MODE_DEFAULT) {
    /* Not a healthy node for deepepd: doctor must fail it, as it does. */
    DG_SAYS(out, "allocation", "FAIL");
    ck_assert_int_eq(rc, 1);
    ck_assert_msg(false, "GPU %s is in compute mode %d, not default: no healthy node to test",
                  gpu, mm / 2);
  }
  tu_skip_part(__func__, "compute mode: read from the GPU and reported (%s), never set: setting "
               "it needs root and an idle GPU, and the GPU machine's settings stay as they are "
               "(DEVICE.md); its FAIL is the decisions' test with a simulated value",
               want.detail);
  const char *checks[] = {"connections", "kernels", "allocation", "memory", "balance"};
  for (int i = 0; i < 5; i++)
    DG_SAYS(out, checks[i], "OK");
  ck_assert_int_eq(rc, 0);
  DG_IN(out, "\"ok\":true,");
  free(out);
  /* The text form: one line per check, each OK. */
  rc = dg_ctl(tu_bin("deepepctl"), d.dir, &out, DW_ARGS("-s", d.sock, "doctor"));
  printf("doctor, as text (exit %d):\n%s", rc, out);
  ck_assert_int_eq(rc, 0);
  for (int i = 0; i < 5; i++) {
    char line[64];
    dw_sfmt(line, sizeof line, "%-12s %-4s  ", checks[i], "OK");
    DG_IN(out, line);
  }
  ck_assert_msg(strstr(out, "to do:") == NULL, "%s", out);
  free(out);
  dw_stop_ok(&d);
}
END_TEST

START_TEST(doctor_warns_of_ranks_sharing_a_gpu_without_mps) {
  struct tu_gpus g;
  struct tu_daemon d;
  char gpu[DEP_UUID_STR_LEN];
  if (!dg_gpu_start(__func__, &g, &d, NULL, gpu))
    return;
  const bool mps = dg_mode_mps(g.uuid[0]) % 2 != 0;
  /* Two rank processes of one job, both on GPU 0 (whatever DEP_TEST_GPUS says: the point). */
  struct dw_child r[2];
  char msg[512];
  for (uint32_t i = 0; i < 2; i++)
    dg_rank(&r[i], d.sock, "dg-shared", i, 2, &dg_small, g.uuid[0]);
  for (uint32_t i = 0; i < 2; i++)
    dg_reported(&r[i], "rank", msg, sizeof msg);
  char *out = NULL;
  int rc = dg_doctor(NULL, &d, mps ? "two rank processes on one GPU, MPS running"
                                   : "two rank processes on one GPU, no MPS", &out);
  char want[300];
  if (mps) {
    DG_SAYS(out, "allocation", "OK");
    dw_sfmt(want, sizeof want, "ranks of job dg-shared in several processes share GPU %s "
            "through MPS", gpu);
    DG_IN(out, want);
    ck_assert_int_eq(rc, 0);
    tu_skip_part(__func__, "MPS runs on this machine, so its absence is not real here: the "
                 "WARN is the decisions' test's (run this test without MPS for the real one)");
  } else {
    DG_SAYS(out, "allocation", "WARN");
    dw_sfmt(want, sizeof want, "ranks of job dg-shared in several processes share GPU %s "
            "without MPS", gpu);
    DG_IN(out, want);
    DG_IN(out, "nvidia-cuda-mps-control -d");
    ck_assert_int_eq(rc, 0); /* a WARN is no failure */
    tu_skip_part(__func__, "MPS does not run on this machine: the OK under MPS is the decisions' "
                 "test's (run this test under MPS for the real one)");
  }
  free(out);
  for (uint32_t i = 0; i < 2; i++)
    dg_finish(&r[i], "rank");
  /* The job gone, no GPU is shared: the warning goes with it. */
  dg_no_jobs(&d);
  rc = dg_doctor(NULL, &d, "after the job", &out);
  DG_SAYS(out, "allocation", "OK");
  ck_assert_msg(strstr(out, "dg-shared in several processes") == NULL, "%s", out);
  ck_assert_int_eq(rc, 0);
  free(out);
  dw_stop_ok(&d);
}
END_TEST

/* ---- gpu: the GPU's memory ---------------------------------------------------------------- */

/* A one-rank shape whose arena is about `bytes` (hidden 16384: 64 KiB a token and parity). */
static struct dep_job_shape dg_shape_of(uint64_t bytes, uint64_t *got) {
  struct dep_job_shape sh = {.hidden = 16384, .num_experts = 8, .topk = 2,
                             .max_ll_tokens_per_rank = 64, .dtype = DEP_DTYPE_BF16};
  struct dep_slab_layout l;
  char why[256];
  for (uint32_t t = 256; t <= 65536; t += 256) {
    sh.max_tokens_per_rank = t;
    ck_assert_msg(dep__slab_layout(&sh, 1, &l, why, sizeof why) == 0, "%s", why);
    if (l.total_bytes >= bytes)
      break;
  }
  ck_assert_uint_ge(l.total_bytes, bytes);
  *got = l.total_bytes;
  return sh;
}

/* Run a one-rank job of shape sh to its end. */
static void dg_job(const struct tu_daemon *d, const char *job, const struct dep_job_shape *sh,
                   const uint8_t uuid[16]) {
  struct dw_child r;
  char msg[512];
  dg_rank(&r, d->sock, job, 0, 1, sh, uuid);
  dg_reported(&r, job, msg, sizeof msg);
  dg_finish(&r, job);
  dg_no_jobs(d);
}

START_TEST(doctor_warns_then_fails_when_the_gpu_has_too_little_memory_for_the_pool) {
  struct tu_gpus g;
  if (!cr_gpu_probe(__func__, &g))
    return;
  /* Job A's arena about 3 GiB, B's about 0.5 GiB, a budget with room for A but not both:
   * B's start unmakes A's cached block.  Made-on-demand (no preallocation). */
  uint64_t a_bytes, b_bytes;
  const struct dep_job_shape big = dg_shape_of(3 * GIB, &a_bytes);
  const struct dep_job_shape small = dg_shape_of(GIB / 2, &b_bytes);
  const uint64_t budget_mib = (a_bytes + b_bytes / 2) / MIB / 2 * 2 + 64;
  char yaml[300];
  dw_sfmt(yaml, sizeof yaml, "preallocation: false\npool:\n  size_per_device: %lluMiB\n"
          "  chunk_size: 2MiB\n  host_size: 64MiB\n", (unsigned long long)budget_mib);
  struct tu_daemon d;
  dg_start(&d, yaml);
  char gpu[DEP_UUID_STR_LEN];
  dep__uuid_str(g.uuid[0], gpu);
  printf("memory: budget %llu MiB, job A %.0f MiB, job B %.0f MiB\n",
         (unsigned long long)budget_mib, (double)a_bytes / MIB, (double)b_bytes / MIB);
  /* 1. A GPU nearly full (1 GiB left, less doctor's own context): the pool's rest does not
   *    fit.  No job seen yet: WARN, exit 0. */
  struct dw_child hog;
  dg_hog_start(&hog, g.uuid[0], GIB);
  char *out = NULL;
  int rc = dg_doctor(NULL, &d, "GPU full, no job seen", &out);
  DG_SAYS(out, "memory", "WARN");
  char want[300];
  dw_sfmt(want, sizeof want, "GPU %s: its pool may still make", gpu);
  DG_IN(out, want);
  DG_IN(out, "preallocation: true");
  ck_assert_int_eq(rc, 0);
  free(out);
  dg_hog_end(&hog, g.uuid[0]);
  /* 2. A runs and ends, B runs and ends (unmaking A's block): with the GPU full again, a job
   *    of A's size could not attach: FAIL, exit 1. */
  dg_job(&d, "dg-big", &big, g.uuid[0]);
  dg_job(&d, "dg-small", &small, g.uuid[0]);
  char *log = tu_daemon_log(&d);
  ck_assert_msg(strstr(log, "to make room for a block of") != NULL,
                "B's start did not unmake A's block:\n%s", log);
  free(log);
  dg_hog_start(&hog, g.uuid[0], GIB);
  rc = dg_doctor(NULL, &d, "GPU full, the largest job's arena unmade", &out);
  DG_SAYS(out, "memory", "FAIL");
  DG_IN(out, "job dg-big, the largest seen here");
  DG_IN(out, "a job that size cannot attach");
  DG_SAYS(out, "allocation", "OK"); /* the pool's budget itself has room for A */
  ck_assert_int_eq(rc, 1);
  DG_IN(out, "\"ok\":false,");
  free(out);
  dg_hog_end(&hog, g.uuid[0]);
  /* 3. The memory back: OK again. */
  rc = dg_doctor(NULL, &d, "GPU memory freed", &out);
  DG_SAYS(out, "memory", "OK");
  ck_assert_int_eq(rc, 0);
  free(out);
  dw_stop_ok(&d);
}
END_TEST

/* ---- gpu: the kernel cache, with a PTX-only library ---------------------------------------- */

START_TEST(doctor_judges_a_ptx_only_library_by_the_daemon_s_cached_compile) {
  struct tu_gpus g;
  if (!cr_gpu_probe(__func__, &g))
    return;
  const char *ptx = getenv("DEP_PTX_BUILD");
  if (ptx == NULL || ptx[0] == '\0') {
    tu_skip(__func__, "set DEP_PTX_BUILD to the directory of a PTX-only build (make "
            "BUILD=build-ptx PTX_ONLY=90 STATIC_DEPS=1 all): this build's fatbin has SASS, "
            "for which the kernel cache is not used");
    return;
  }
  char path[600];
  dw_sfmt(path, sizeof path, "%s/deepepd", ptx);
  ck_assert_msg(access(path, X_OK) == 0, "DEP_PTX_BUILD=%s has no deepepd", ptx);
  const char *self = getenv("DEP_BUILD");
  char self_dir[600];
  dw_sfmt(self_dir, sizeof self_dir, "%s", self != NULL ? self : "build");
  char top[200], cache[300], yaml[400];
  tu_tmpdir(top, sizeof top);
  dw_sfmt(cache, sizeof cache, "%s/cache", top);
  dw_sfmt(yaml, sizeof yaml, "kernel_cache_dir: %s\n", cache);
  struct tu_daemon d;
  char *out = NULL;
  /* 1. The PTX-only build's own daemon compiled its PTX into the cache: OK. */
  setenv("DEP_BUILD", ptx, 1);
  dg_start(&d, yaml);
  int rc = dg_doctor(ptx, &d, "PTX-only library, its daemon's cached compile", &out);
  ck_assert_msg(strstr(out, "SASS for it in the fatbin") == NULL,
                "DEP_PTX_BUILD=%s has SASS for this GPU: build it with PTX_ONLY=90", ptx);
  DG_SAYS(out, "kernels", "OK");
  DG_IN(out, "the fatbin has only PTX for it");
  DG_IN(out, "the daemon lends its cached compile of it");
  ck_assert_int_eq(rc, 0);
  free(out);
  dw_stop_ok(&d);
  /* 2. The same library against a daemon of a SASS build, which lends nothing: WARN. */
  setenv("DEP_BUILD", self_dir, 1);
  dg_start(&d, yaml);
  rc = dg_doctor(ptx, &d, "PTX-only library, a SASS build's daemon", &out);
  DG_SAYS(out, "kernels", "WARN");
  DG_IN(out, "each trainer process compiles it at its start");
  DG_IN(out, "install deepepd and libdeepep-client from one build");
  ck_assert_int_eq(rc, 0);
  free(out);
  dw_stop_ok(&d);
  /* 3. A cache directory its group may write (who could put code into every trainer): the
   *    PTX-only daemon refuses to start, saying what to do, and doctor fails. */
  ck_assert_int_eq(chmod(cache, 0775), 0);
  setenv("DEP_BUILD", ptx, 1);
  memset(&d, 0, sizeof d);
  ck_assert_int_eq(tu_daemon_start(&d, yaml), -1);
  char *log = tu_daemon_log(&d);
  ck_assert_msg(strstr(log, "is writable by its group") != NULL && strstr(log, "chmod go-w"),
                "the daemon's log:\n%s", log);
  free(log);
  rc = dg_doctor(ptx, &d, "PTX-only daemon refused its cache directory", &out);
  DG_SAYS(out, "connections", "FAIL");
  DG_SAYS(out, "kernels", "FAIL");
  DG_IN(out, "not checked: deepepd did not answer");
  DG_IN(out, "journalctl -u deepepd says why");
  ck_assert_int_eq(rc, 1);
  free(out);
  setenv("DEP_BUILD", self_dir, 1);
  tu_daemon_cleanup(&d);
  tu_rmtree(top);
}
END_TEST

Suite *doctor_suite(void);
Suite *doctor_suite(void) {
  Suite *s = suite_create("doctor");
  TCase *t = tcase_create("decisions");
  tcase_add_test(t, kernels_pass_with_sass_and_fail_with_no_code_for_the_gpu);
  tcase_add_test(t, kernels_with_ptx_only_need_the_daemon_s_compile_of_this_build);
  tcase_add_test(t, compute_modes_other_than_default_fail);
  tcase_add_test(t, ranks_sharing_a_gpu_in_several_processes_want_mps);
  tcase_add_test(t, a_gpu_is_shared_by_ranks_of_one_job_in_different_processes);
  tcase_add_test(t, memory_judges_the_pool_s_rest_and_the_largest_job_against_free_memory);
  tcase_add_test(t, tcp_slow_start_after_idle_warns_only_where_peers_run_over_tcp);
  suite_add_tcase(s, t);
  t = tcase_create("gpu");
  tcase_set_tags(t, "gpu");
  tcase_set_timeout(t, 120); /* daemon starts on cuda (a PTX compile in one), rank processes */
  tcase_add_test(t, doctor_passes_a_healthy_gpu_node_and_reports_its_real_compute_mode);
  tcase_add_test(t, doctor_warns_of_ranks_sharing_a_gpu_without_mps);
  tcase_add_test(t, doctor_warns_then_fails_when_the_gpu_has_too_little_memory_for_the_pool);
  tcase_add_test(t, doctor_judges_a_ptx_only_library_by_the_daemon_s_cached_compile);
  suite_add_tcase(s, t);
  return s;
}
