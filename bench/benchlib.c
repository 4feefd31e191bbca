/*
 * benchlib.c — shared benchmark helpers (benchlib.h).
 */
#include "benchlib.h"

#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cudadrv.h"

double bench_now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

void bench_sort(double *v, size_t n) { qsort(v, n, sizeof *v, cmp_double); }

/* In the child: the number of visible GPUs, or -1 with why. */
static int gpu_count(char *why, size_t len) {
  const struct cudadrv *cu = cudadrv_load(why, len);
  int n = 0;
  if (cu == NULL)
    return -1;
  CUresult r = cu->cuDeviceGetCount(&n);
  if (r != CUDA_SUCCESS) {
    snprintf(why, len, "cuDeviceGetCount: %s", cudadrv_errstr(r));
    return -1;
  }
  return n;
}

int bench_gpus(int want, char *why, size_t len) {
  struct {
    int n;
    char why[256];
  } a = {-1, ""};
  int p[2];
  if (want < 0) {
    snprintf(why, len, "-g %d: give a number of GPUs, or 0 for all", want);
    return -1;
  }
  if (pipe(p) != 0) {
    snprintf(why, len, "pipe failed");
    return -1;
  }
  fflush(stdout);
  pid_t pid = fork();
  if (pid == 0) {
    close(p[0]);
    a.n = gpu_count(a.why, sizeof a.why);
    _exit(write(p[1], &a, sizeof a) == (ssize_t)sizeof a ? 0 : 1);
  }
  close(p[1]);
  ssize_t got = pid > 0 ? read(p[0], &a, sizeof a) : -1;
  close(p[0]);
  if (pid > 0)
    waitpid(pid, NULL, 0);
  if (got != (ssize_t)sizeof a) {
    snprintf(why, len, "the process asking the driver for its GPUs died");
    return -1;
  }
  if (a.n < 0) {
    snprintf(why, len, "%s", a.why);
    return -1;
  }
  if (want > a.n) {
    snprintf(why, len, "-g %d asks for %d GPUs but only %d %s visible (check "
             "CUDA_VISIBLE_DEVICES, or -g 0 for all)", want, want, a.n, a.n == 1 ? "is" : "are");
    return -1;
  }
  return want == 0 ? a.n : want;
}

int bench_gpu_of_rank(int r, int ngpus) { return ngpus > 0 ? r % ngpus : 0; }
