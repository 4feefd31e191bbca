/*
 * reg.c — RDMA memory registration, timed: ibv_reg_mr and ibv_dereg_mr of
 * host memory on the first RDMA device, through the daemon's own seam to
 * libibverbs (daemon/rdmadrv.h: dlopen, so the benchmark also runs where
 * rdma-core is not installed, and says so).  What a job pays at each start
 * for its memory when nobody keeps the registration (DESIGN §7).
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include "../benchlib.h"
#include "peers.h"
#include "rdmadrv.h"

int reg_measure(uint64_t bytes, int reps, double *reg_ms, double *dereg_ms, char *dev,
                size_t devlen, char *why, size_t whylen) {
  const struct rdmadrv *rd = rdmadrv_load(why, whylen);
  if (rd == NULL)
    return -1;
  int n = 0;
  errno = 0;
  struct ibv_device **list = rd->ibv.get_device_list(&n);
  if (list == NULL || n == 0) {
    int e = errno;
    if (list != NULL)
      snprintf(why, whylen, "no RDMA device");
    else if (e == ENOSYS) /* as rdmadrv.c's probe says it */
      snprintf(why, whylen, "no RDMA device (no kernel support: ib_uverbs not loaded?)");
    else
      snprintf(why, whylen, "no RDMA device (ibv_get_device_list: %s)", strerror(e));
    if (list != NULL)
      rd->ibv.free_device_list(list);
    return -1;
  }
  snprintf(dev, devlen, "%s", rd->ibv.get_device_name(list[0]));
  int rc = -1;
  struct ibv_context *ctx = rd->ibv.open_device(list[0]);
  struct ibv_pd *pd = NULL;
  void *buf = MAP_FAILED;
  if (ctx == NULL) {
    snprintf(why, whylen, "ibv_open_device %s: %s", dev, strerror(errno));
    goto out;
  }
  if ((pd = rd->ibv.alloc_pd(ctx)) == NULL) {
    snprintf(why, whylen, "ibv_alloc_pd: %s", strerror(errno));
    goto out;
  }
  /* Registration pins the pages: the locked-memory limit must allow it (root may raise it). */
  struct rlimit rl = {RLIM_INFINITY, RLIM_INFINITY};
  (void)setrlimit(RLIMIT_MEMLOCK, &rl);
  buf = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (buf == MAP_FAILED) {
    snprintf(why, whylen, "mmap of %llu bytes: %s", (unsigned long long)bytes, strerror(errno));
    goto out;
  }
  /* Touched, as a job's buffers are by the time they are registered. */
  long page = sysconf(_SC_PAGESIZE);
  for (uint64_t off = 0; off < bytes; off += (uint64_t)page)
    ((volatile char *)buf)[off] = 1;
  int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
  for (int r = 0; r < reps; r++) {
    double t = bench_now_ms();
    struct ibv_mr *mr = rd->ibv.reg_mr(pd, buf, bytes, access);
    reg_ms[r] = bench_now_ms() - t;
    if (mr == NULL) {
      snprintf(why, whylen, "ibv_reg_mr of %llu bytes on %s: %s", (unsigned long long)bytes, dev,
               strerror(errno));
      goto out;
    }
    t = bench_now_ms();
    int e = rd->ibv.dereg_mr(mr);
    dereg_ms[r] = bench_now_ms() - t;
    if (e != 0) {
      snprintf(why, whylen, "ibv_dereg_mr: %s", strerror(e));
      goto out;
    }
  }
  rc = 0;
out:
  if (buf != MAP_FAILED)
    munmap(buf, bytes);
  if (pd != NULL)
    rd->ibv.dealloc_pd(pd);
  if (ctx != NULL)
    rd->ibv.close_device(ctx);
  rd->ibv.free_device_list(list);
  return rc;
}
