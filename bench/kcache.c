/*
 * kcache.c — what the daemon's kernel cache saves a trainer: attach-to-ready
 * of fresh one-rank processes on GPU 0, each a new process (so that each
 * loads the kernels as a restarted trainer does), with where its kernels
 * came from: the daemon's compile (lent at attach) or the library's own
 * fatbin (SASS, or PTX the driver compiles in this process).  The driver's
 * own JIT cache and the library's choice are the environment's:
 * CUDA_CACHE_DISABLE=1 for a cold driver cache, DEEPEP_OWN_KERNELS=1 to
 * load the library's fatbin even where the daemon lends a compile.
 * bench/kcache.sh runs the cases (a PTX-only build with an empty and a
 * warm cache, and without it; a SASS build) in one go.
 *
 *   kcache -s SOCKET [-i N] [-l LABEL]
 *
 * Prints one line per process and a summary (median, min, max of the
 * attach and of its kernel set-up).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "benchlib.h"
#include "cudadrv.h"
#include "deepep.h"
#include "deepep_daemon.h"

/* One process: attach a job of one rank on GPU 0, report, detach. */
static int one(const char *sock, int i, int out_fd) {
  char why[256] = "";
  const struct cudadrv *cu = cudadrv_load(why, sizeof why);
  if (cu == NULL) {
    fprintf(stderr, "kcache: %s\n", why);
    return 1;
  }
  CUdevice dev;
  CUuuid u;
  if (cu->cuDeviceGet(&dev, 0) != CUDA_SUCCESS || cu->cuDeviceGetUuid(&u, dev) != CUDA_SUCCESS) {
    fprintf(stderr, "kcache: no GPU 0\n");
    return 1;
  }
  struct dep_attach_args a = {
      .size = sizeof a,
      .rank = 0, .world_size = 1, .local_rank = 0, .local_world_size = 1,
      .shape = {.max_tokens_per_rank = 128, .hidden = 4096, .num_experts = 8, .topk = 2,
                .dtype = DEP_DTYPE_BF16},
  };
  snprintf(a.job_id, sizeof a.job_id, "kcache-%d-%d", (int)getpid(), i);
  memcpy(a.device_uuid, u.bytes, 16);
  dep_client_t *c = NULL;
  double t0 = bench_now_ms();
  int rc = dep_client_new(&c);
  if (rc == 0)
    rc = dep_connect(c, sock);
  if (rc == 0)
    rc = dep_attach(c, &a);
  double total = bench_now_ms() - t0;
  if (rc != 0) {
    fprintf(stderr, "kcache: attach: %s (%s)\n", dep_errmsg(c), dep_errname(rc));
    return 1;
  }
  struct dep_attach_times t = {.size = sizeof t};
  dep_attach_times(c, &t);
  double line[4] = {total, t.setup_ms, t.warmup_ms, dep__client_kernels_lent(c) ? 1.0 : 0.0};
  if (write(out_fd, line, sizeof line) != (ssize_t)sizeof line)
    return 1;
  dep_detach(c);
  dep_client_free(c);
  return 0;
}

int main(int argc, char **argv) {
  const char *sock = NULL, *label = "";
  int n = 10, o;
  while ((o = getopt(argc, argv, "s:i:l:")) != -1) {
    if (o == 's')
      sock = optarg;
    else if (o == 'i')
      n = atoi(optarg);
    else if (o == 'l')
      label = optarg;
    else
      return 2;
  }
  if (sock == NULL || n < 1 || n > 1000) {
    fprintf(stderr, "usage: kcache -s SOCKET [-i N (1-1000)] [-l LABEL]\n");
    return 2;
  }
  double total[1000], setup[1000];
  int lent = 0;
  for (int i = 0; i < n; i++) {
    int p[2];
    if (pipe(p) != 0)
      return 1;
    pid_t pid = fork();
    if (pid == 0) {
      close(p[0]);
      _exit(one(sock, i, p[1]));
    }
    close(p[1]);
    double line[4];
    ssize_t got = read(p[0], line, sizeof line);
    close(p[0]);
    int st = 0;
    waitpid(pid, &st, 0);
    if (got != (ssize_t)sizeof line || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
      fprintf(stderr, "kcache: process %d failed\n", i);
      return 1;
    }
    total[i] = line[0];
    setup[i] = line[1];
    lent += line[3] != 0;
    printf("%s process %d: attach %.2f ms, kernel set-up %.2f ms, warm-up %.2f ms, kernels: %s\n",
           label, i, line[0], line[1], line[2], line[3] != 0 ? "daemon's compile" : "own fatbin");
  }
  bench_sort(total, (size_t)n);
  bench_sort(setup, (size_t)n);
  printf("%s: %d processes, kernels lent to %d; attach median %.2f ms (min %.2f, max %.2f); "
         "kernel set-up median %.2f ms (min %.2f, max %.2f)\n",
         label, n, lent, total[n / 2], total[0], total[n - 1], setup[n / 2], setup[0],
         setup[n - 1]);
  return 0;
}
