/*
 * cudaranks.c — rank processes and rank threads on the cuda backend for
 * check_cuda_ops.c (cudaranks.h).
 */
#include "clienttest.h"
#include "cudaranks.h"

#include <check.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

bool cr_on_cuda(void) {
  const char *b = getenv("DEP_TEST_BACKEND");
  return b != NULL && strcmp(b, "cuda") == 0;
}

bool cr_gpu_probe(const char *test, struct tu_gpus *g) {
  if (!cr_on_cuda()) {
    tu_skip(test, "runs against a cuda daemon; set DEP_TEST_BACKEND=cuda (make check-gpu) on a "
            "machine with a GPU");
    return false;
  }
  char why[256] = "";
  int rc = tu_gpus_probe(g, why, sizeof why);
  ck_assert_msg(rc >= 0, "%s", why);
  if (rc == 0)
    tu_skip(test, "no usable GPU (%s)", why);
  return rc > 0;
}

bool cr_gpu_ready(const char *test) {
  struct tu_gpus g;
  return cr_gpu_probe(test, &g);
}

uint64_t cr_ms_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

int rk_open(struct rk *k, const char *sock, const char *job, const struct dep_job_shape *sh,
            uint32_t rank, uint32_t W) {
  return rk_open_at(k, sock, job, sh, rank, W, rank, W);
}

int rk_open_at(struct rk *k, const char *sock, const char *job, const struct dep_job_shape *sh,
               uint32_t rank, uint32_t W, uint32_t local, uint32_t lws) {
  char why[256] = "";
  k->rank = rank, k->W = W;
  k->cu = cudadrv_load(why, sizeof why);
  if (k->cu == NULL)
    return ow_fail(k->msg, "rank %u: %s", rank, why);
  struct dep_attach_args a = {.size = sizeof a, .rank = rank, .world_size = W, .local_rank = local,
                              .local_world_size = lws, .shape = *sh, .flags = k->flags};
  snprintf(a.job_id, sizeof a.job_id, "%s", job);
  /* This rank's GPU's primary context current on this thread before
   * anything else: dep_attach keeps a current context of the device it
   * binds, and the stream and buffers below are made in it. */
  int ordinal = 0;
  if (tu_gpu_for_rank(rank, &ordinal, why, sizeof why) != 0)
    return ow_fail(k->msg, "rank %u: %s", rank, why);
  CUuuid u;
  CR_CU(k, k->cu->cuDeviceGet(&k->dev, ordinal), "cuDeviceGet");
  CR_CU(k, k->cu->cuDeviceGetUuid(&u, k->dev), "cuDeviceGetUuid");
  CR_CU(k, k->cu->cuDevicePrimaryCtxRetain(&k->ctx, k->dev), "cuDevicePrimaryCtxRetain");
  CR_CU(k, k->cu->cuCtxSetCurrent(k->ctx), "cuCtxSetCurrent");
  memcpy(a.device_uuid, u.bytes, 16);
  k->args = a;
  if (dep_client_new(&k->c) != 0 || dep_connect(k->c, sock) != 0 || dep_attach(k->c, &a) != 0)
    return ow_fail(k->msg, "rank %u: connect/attach: %s", rank, dep_errmsg(k->c));
  if (dep_handle_new(k->c, &k->h) != 0)
    return ow_fail(k->msg, "rank %u: dep_handle_new", rank);
  CR_CU(k, k->cu->cuStreamCreate(&k->s, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
  struct dep_slab_layout lay;
  ck_assert_int_eq(dep__slab_layout(sh, W, &lay, why, sizeof why), 0);
  k->h_ = sh->hidden, k->K = sh->topk, k->E = sh->num_experts, k->mt = sh->max_tokens_per_rank;
  k->le = k->E / W, k->maxll = lay.max_ll_tokens, k->rows = W * lay.max_ll_tokens;
  size_t h = k->h_, rows_tp = (size_t)W * k->mt, lrows = (size_t)k->le * k->rows;
  size_t sz[B_COUNT] = {k->mt * h * 2, k->mt * k->K * 8, k->mt * k->K * 4, rows_tp * h * 2,
                        lrows * h * 2, W * 4, k->E * 4, (size_t)k->mt * W, rows_tp * h * 2,
                        rows_tp * k->K * 4, rows_tp * k->K * 4, k->le * 4, k->mt * h * 2,
                        lrows * h * 2, lrows * (h / 128) * 4, k->le * 4, k->maxll * h * 2,
                        lrows * 4, (size_t)k->le * W * 8};
  size_t most = 0;
  for (int i = 0; i < B_COUNT; i++) {
    k->sz[i] = sz[i];
    most = sz[i] > most ? sz[i] : most;
    CR_CU(k, k->cu->cuMemAlloc(&k->b[i], sz[i] + 16), "cuMemAlloc");
  }
  k->host = malloc(most + 16);
  return k->host == NULL ? ow_fail(k->msg, "out of memory") : 0;
}

void rk_close(struct rk *k) {
  if (k->cu != NULL && k->s != NULL)
    k->cu->cuStreamSynchronize(k->s);
  for (int i = 0; i < B_COUNT; i++)
    if (k->b[i] != 0)
      k->cu->cuMemFree(k->b[i]);
  if (k->s != NULL)
    k->cu->cuStreamDestroy(k->s);
  dep_handle_free(k->h);
  if (k->c != NULL)
    dep_detach(k->c);
  dep_client_free(k->c);
  free(k->host);
  if (k->ctx != NULL)
    k->cu->cuDevicePrimaryCtxRelease(k->dev);
}

/* On the rank's stream, and whole before it returns: a cuMemcpyHtoD from pageable memory
 * may return before its DMA lands, ordered after nothing on a non-blocking stream, so the
 * next operation on k->s could read the buffer's old bytes. */
int cr_put(struct rk *k, int i, const void *src, size_t n) {
  return cr_put_at(k, k->b[i], src, n);
}
int cr_put_at(struct rk *k, CUdeviceptr dst, const void *src, size_t n) {
  if (n > 0) {
    CR_CU(k, k->cu->cuMemcpyHtoDAsync(dst, src, n, k->s), "cuMemcpyHtoDAsync");
    CR_CU(k, k->cu->cuStreamSynchronize(k->s), "cuStreamSynchronize");
  }
  return 0;
}
int cr_poison(struct rk *k, int i, uint8_t pz) {
  CR_CU(k, k->cu->cuMemsetD8Async(k->b[i], pz, k->sz[i], k->s), "cuMemsetD8Async");
  return 0;
}
int cr_get(struct rk *k, int i) {
  CR_CU(k, k->cu->cuStreamSynchronize(k->s), "cuStreamSynchronize");
  CR_CU(k, k->cu->cuMemcpyDtoH(k->host, k->b[i], k->sz[i]), "cuMemcpyDtoH");
  return 0;
}

/* ---- worlds: rank processes, or rank threads -------------------------------------------- */



void cr_world_msgs(struct cr_world *w) {
  w->msg = mmap(NULL, OW_MAXW * OW_MSG, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  ck_assert(w->msg != MAP_FAILED);
}

void cr_world_msgs_free(struct cr_world *w) { munmap(w->msg, OW_MAXW * OW_MSG); }

void cr_world_start(struct cr_world *w, const char *yaml) {
  ck_assert_msg(tu_daemon_start(&w->dm, yaml) == 0, "deepepd did not start on the cuda backend");
  cr_world_msgs(w);
}

void cr_world_stop(struct cr_world *w) {
  dep_client_t *c = cl_connect(w->dm.sock);
  struct dep_status *st = NULL;
  for (int i = 0; i < 200; i++) {
    ck_assert_msg(dep_status(c, &st) == 0, "deepepd stopped answering: %s", dep_errmsg(c));
    uint32_t jobs = st->num_jobs;
    dep_status_free(st);
    if (jobs == 0)
      break;
    ck_assert_msg(i < 199, "deepepd still holds %u jobs", jobs);
    usleep(10000);
  }
  dep_client_free(c);
  ck_assert_int_eq(tu_daemon_stop(&w->dm), 0);
  tu_daemon_cleanup(&w->dm);
  cr_world_msgs_free(w);
}

/* Every failed rank's message into out: how many failed. */
static int cr_failures(struct cr_world *w, uint32_t W, const int *failed, char *out, size_t len) {
  size_t o = 0;
  int n = 0;
  out[0] = '\0';
  for (uint32_t r = 0; r < W; r++)
    if (failed[r]) {
      n++;
      o += (size_t)snprintf(out + o, o < len ? len - o : 0, "\n  rank %u: %s", r,
                            w->msg[r * OW_MSG] ? w->msg + r * OW_MSG : "(stopped)");
    }
  return n;
}

static void cr_report(struct cr_world *w, uint32_t W, const int *failed, const char *what) {
  static char out[OW_FAILS_LEN];
  int n = cr_failures(w, W, failed, out, sizeof out);
  OW_ASSERT_NONE_FAILED(what, n, out);
}

void cr_run_procs(struct cr_world *w, const char *job, const struct dep_job_shape *sh, uint32_t W,
                  cr_rank_body fn, void *arg, const char *what) {
  struct cr_place p = {.wait_all = false};
  for (uint32_t r = 0; r < W; r++)
    p.sock[r] = w->dm.sock, p.local[r] = r, p.lws[r] = W;
  static char out[OW_FAILS_LEN];
  int n = cr_run_procs_placed(w, &p, job, sh, W, fn, arg, out, sizeof out);
  OW_ASSERT_NONE_FAILED(what, n, out);
}

int cr_run_procs_placed(struct cr_world *w, const struct cr_place *p, const char *job,
                        const struct dep_job_shape *sh, uint32_t W, cr_rank_body fn, void *arg,
                        char *out, size_t len) {
  memset(w->msg, 0, OW_MAXW * OW_MSG);
  pid_t pid[OW_MAXW];
  pid_t parent = getpid();
  for (uint32_t r = 0; r < W; r++) {
    fflush(stdout);
    pid[r] = fork();
    ck_assert(pid[r] >= 0);
    if (pid[r] == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent)
        _exit(3);
      struct rk k;
      memset(&k, 0, sizeof k);
      k.msg = w->msg + r * OW_MSG;
      k.flags = p->flags;
      int rc = rk_open_at(&k, p->sock[r], job, sh, r, W, p->local[r], p->lws[r]) || fn(&k, arg);
      rk_close(&k);
      _exit(rc ? 1 : 0);
    }
  }
  int failed[OW_MAXW] = {0}, done[OW_MAXW] = {0}, left = (int)W, nfail = 0;
  uint64_t deadline = cr_ms_now() + 200000;
  while (left > 0) {
    int st, progressed = 0;
    for (uint32_t r = 0; r < W; r++) {
      if (done[r] || waitpid(pid[r], &st, WNOHANG) == 0)
        continue;
      done[r] = 1, left--, progressed = 1;
      failed[r] = !WIFEXITED(st) || WEXITSTATUS(st) != 0;
      nfail += failed[r];
    }
    if (left > 0 && ((nfail > 0 && !p->wait_all) || cr_ms_now() > deadline)) {
      for (uint32_t r = 0; r < W; r++) /* peers of a failed rank would only wait out their bound */
        if (!done[r])
          kill(pid[r], SIGKILL);
    } else if (!progressed) {
      usleep(1000);
    }
  }
  return cr_failures(w, W, failed, out, len);
}

struct thr {
  pthread_t t;
  pthread_barrier_t *ready;
  struct rk k;
  const char *sock, *job;
  const struct dep_job_shape *sh;
  cr_rank_body fn;
  void *arg;
  int rc;
};

static void *thr_main(void *p) {
  struct thr *t = p;
  t->rc = rk_open(&t->k, t->sock, t->job, t->sh, t->k.rank, t->k.W);
  /* Every rank of the process attached and allocated before any calls:
   * the driver may make an allocation wait for running kernels, which
   * here wait for this very process (see client/cuda_ops.h). */
  pthread_barrier_wait(t->ready);
  t->rc = t->rc || t->fn(&t->k, t->arg);
  rk_close(&t->k);
  return NULL;
}

void cr_run_threads(struct cr_world *w, const char *job, const struct dep_job_shape *sh,
                    uint32_t W, cr_rank_body fn, void *arg, const char *what) {
  memset(w->msg, 0, OW_MAXW * OW_MSG);
  /* One hardware queue per stream, or kernels of two ranks queued in one
   * queue wait for each other (cuda_ops.h); this process has not started
   * CUDA yet (cr_gpu_ready probes in a child). */
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 1);
  struct thr t[OW_MAXW];
  memset(t, 0, sizeof t);
  pthread_barrier_t ready;
  ck_assert_int_eq(pthread_barrier_init(&ready, NULL, W), 0);
  for (uint32_t r = 0; r < W; r++) {
    t[r] = (struct thr){.ready = &ready, .sock = w->dm.sock, .job = job, .sh = sh, .fn = fn,
                        .arg = arg};
    t[r].k.rank = r, t[r].k.W = W, t[r].k.msg = w->msg + r * OW_MSG;
    ck_assert_int_eq(pthread_create(&t[r].t, NULL, thr_main, &t[r]), 0);
  }
  int failed[OW_MAXW] = {0};
  for (uint32_t r = 0; r < W; r++) {
    pthread_join(t[r].t, NULL);
    failed[r] = t[r].rc != 0;
  }
  pthread_barrier_destroy(&ready);
  cr_report(w, W, failed, what);
}
