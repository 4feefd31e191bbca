/*
 * ceiling.c — the ceilings the dispatch/combine benchmark (bench/ep.c) holds
 * its figures against, measured in the same run: a copy of each op's bytes
 * within one GPU (or memcpy on the host backend), the op's traffic done by
 * peer copies when the ranks span GPUs, and the plain GPU 0 -> GPU 1 rate.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "../benchlib.h"
#include "ep.h"

static void fill_tokens(struct rank *k, uint8_t *p, uint64_t n) {
  size_t xb = (size_t)k->o->shape.max_tokens_per_rank * k->o->shape.hidden * 2;
  for (uint64_t off = 0; off < n; off += xb)
    upload(k, p + off, k->hx, n - off < xb ? (size_t)(n - off) : xb);
}

/*
 * The same-GPU copy ceiling (every rank on one GPU, or the host backend):
 * each rank copies its own byte count of each op, all ranks at once, from a
 * source filled with the (random) tokens.
 */
void copy_ceiling(struct rank *k) {
  uint64_t most = 0;
  for (int op = 0; op < NOPS; op++) {
    uint64_t b = rank_bytes(k->s, k->r, op, k->n);
    most = b > most ? b : most;
  }
  uint8_t *src = balloc(k, most), *dst = balloc(k, most);
  fill_tokens(k, src, most);
  for (int op = 0; op < NOPS; op++) {
    size_t n = rank_bytes(k->s, k->r, op, k->n);
    double *out = tcopy(k, op);
    for (int i = -2; i < k->o->reps; i++) { /* two untimed copies warm it up */
      double rel = bar_wait(k), ms;
      if (k->cuda) {
        float f;
        CK(cu->cuEventRecord(k->e0, k->st));
        CK(cu->cuMemcpyDtoDAsync((CUdeviceptr)(uintptr_t)dst, (CUdeviceptr)(uintptr_t)src, n,
                                 k->st));
        CK(cu->cuEventRecord(k->e1, k->st));
        CK(cu->cuEventSynchronize(k->e1));
        CK(cu->cuEventElapsedTime(&f, k->e0, k->e1));
        ms = f;
      } else {
        memcpy(dst, src, n);
        ms = bench_now_ms() - rel;
      }
      if (i >= 0)
        out[i] = ms;
    }
  }
  bfree(k, src);
  bfree(k, dst);
}

/* Where this rank's copies to rank d land, and the stream they run on. */
struct peer_dst {
  CUdevice dev;    /* rank d's GPU */
  CUcontext ctx;   /* the context the buffer was made in: ours, or d's GPU's primary one */
  bool other_gpu;  /* ctx is another GPU's primary context, retained here */
  CUdeviceptr buf;
  CUstream st;     /* this rank's stream for its copies to d (in our context) */
  CUevent done;
};

/*
 * A buffer of n bytes on rank d's GPU for this rank's copies.  On another
 * GPU it is made in that GPU's primary context (retained in this process),
 * with peer access enabled from ours, so the copies go straight over the
 * GPUs' link and not through the host.
 */
static void peer_dst_open(struct rank *k, int d, uint64_t n, struct peer_dst *p) {
  CK(cu->cuDeviceGet(&p->dev, bench_gpu_of_rank(d, k->o->gpus)));
  p->ctx = k->ctx;
  p->other_gpu = p->dev != k->dev;
  if (!p->other_gpu) {
    CK(cu->cuMemAlloc(&p->buf, n));
  } else {
    int can = 0;
    CK(cu->cuDeviceCanAccessPeer(&can, k->dev, p->dev));
    if (!can)
      fail("rank %d: GPU %d cannot reach GPU %d peer to peer (cuDeviceCanAccessPeer), so there "
           "is no peer-copy ceiling to measure; run with -g 1", k->r, (int)k->dev, (int)p->dev);
    CK(cu->cuDevicePrimaryCtxRetain(&p->ctx, p->dev));
    /* From our context (current) to theirs; another rank of this process
     * on our GPU may have done it already. */
    CUresult r = cu->cuCtxEnablePeerAccess(p->ctx, 0);
    if (r != CUDA_SUCCESS && r != CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED)
      fail("rank %d: cuCtxEnablePeerAccess(GPU %d -> GPU %d) failed: %s", k->r, (int)k->dev,
           (int)p->dev, cudadrv_errstr(r));
    CUcontext ours;
    CK(cu->cuCtxPushCurrent(p->ctx));
    CK(cu->cuMemAlloc(&p->buf, n));
    CK(cu->cuCtxPopCurrent(&ours));
  }
  CK(cu->cuStreamCreate(&p->st, CU_STREAM_NON_BLOCKING));
  CK(cu->cuEventCreate(&p->done, CU_EVENT_DISABLE_TIMING));
}

static void peer_dst_close(struct peer_dst *p) {
  CK(cu->cuStreamDestroy(p->st));
  CK(cu->cuEventDestroy(p->done));
  if (!p->other_gpu) {
    CK(cu->cuMemFree(p->buf));
    return;
  }
  CUcontext ours;
  CK(cu->cuCtxPushCurrent(p->ctx));
  CK(cu->cuMemFree(p->buf));
  CK(cu->cuCtxPopCurrent(&ours));
  CK(cu->cuDevicePrimaryCtxRelease(p->dev));
}

/*
 * The peer-copy ceiling, for ranks on several GPUs: each op's traffic done
 * by copies, all ranks at once, every rank sending every rank (itself
 * included) the bytes the op sent it: cuMemcpyPeerAsync into a buffer on
 * the destination's GPU, cuMemcpyDtoDAsync where the destination shares
 * this rank's GPU.  The copies to different ranks run on streams of their
 * own, forked from this rank's stream and joined back into it, so they
 * overlap as the operation's writes to every peer do; the time is taken
 * with events on this rank's stream, around the fork and the join.
 */
void peer_copy_ceiling(struct rank *k) {
  const uint64_t (*b)[MAX_RANKS] = (const uint64_t (*)[MAX_RANKS])k->s->bytes[k->r];
  struct peer_dst dst[MAX_RANKS];
  memset(dst, 0, sizeof dst);
  uint64_t most = 0;
  for (int d = 0; d < k->n; d++) {
    uint64_t m = 0;
    for (int op = 0; op < NOPS; op++)
      m = b[op][d] > m ? b[op][d] : m;
    most = m > most ? m : most;
    if (m > 0)
      peer_dst_open(k, d, m, &dst[d]);
  }
  uint8_t *src = balloc(k, most);
  fill_tokens(k, src, most);
  const CUdeviceptr from = (CUdeviceptr)(uintptr_t)src;
  for (int op = 0; op < NOPS; op++) {
    double *out = tcopy(k, op);
    for (int i = -2; i < k->o->reps; i++) { /* two untimed rounds warm it up */
      bar_wait(k);
      CK(cu->cuEventRecord(k->e0, k->st));
      for (int d = 0; d < k->n; d++) {
        struct peer_dst *p = &dst[d];
        if (b[op][d] == 0)
          continue;
        CK(cu->cuStreamWaitEvent(p->st, k->e0, 0));
        if (p->other_gpu)
          CK(cu->cuMemcpyPeerAsync(p->buf, p->ctx, from, k->ctx, b[op][d], p->st));
        else
          CK(cu->cuMemcpyDtoDAsync(p->buf, from, b[op][d], p->st));
        CK(cu->cuEventRecord(p->done, p->st));
        CK(cu->cuStreamWaitEvent(k->st, p->done, 0));
      }
      float ms;
      CK(cu->cuEventRecord(k->e1, k->st));
      CK(cu->cuEventSynchronize(k->e1));
      CK(cu->cuEventElapsedTime(&ms, k->e0, k->e1));
      if (i >= 0)
        out[i] = ms;
    }
  }
  CK(cu->cuStreamSynchronize(k->st));
  for (int d = 0; d < k->n; d++)
    if (dst[d].buf != 0)
      peer_dst_close(&dst[d]);
  bfree(k, src);
}

/* ---- the plain pairwise figure: GPU 0 and GPU 1 -------------------------------- */

#define PAIR_BYTES (256ull << 20)

/*
 * In a child process: PAIR_BYTES by cuMemcpyPeerAsync from GPU 0 to GPU 1
 * alone, then in both directions at once (each on a stream of its sending
 * GPU, issued back to back), reps times each after two untimed rounds.
 * one[i] and both[i] get the time of round i, the slower direction's for
 * both.  The process ends after this; the driver frees what it made.
 */
static void pair_measure(const struct opts *o, double *one, double *both) {
  cuda_load();
  CUdevice dv[2];
  CUcontext ctx[2];
  CUstream st[2];
  CUevent e0[2], e1[2];
  CUdeviceptr src[2], dst[2];
  for (int g = 0; g < 2; g++)
    CK(cu->cuDeviceGet(&dv[g], g));
  for (int g = 0; g < 2; g++) {
    int can = 0;
    CK(cu->cuDeviceCanAccessPeer(&can, dv[g], dv[1 - g]));
    if (!can)
      fail("GPU %d cannot reach GPU %d peer to peer (cuDeviceCanAccessPeer)", g, 1 - g);
    CK(cu->cuDevicePrimaryCtxRetain(&ctx[g], dv[g]));
  }
  for (int g = 0; g < 2; g++) { /* GPU g's buffers, stream and events, made in its context */
    CK(cu->cuCtxSetCurrent(ctx[g]));
    CUresult r = cu->cuCtxEnablePeerAccess(ctx[1 - g], 0);
    if (r != CUDA_SUCCESS && r != CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED)
      fail("cuCtxEnablePeerAccess(GPU %d -> GPU %d) failed: %s", g, 1 - g, cudadrv_errstr(r));
    CK(cu->cuMemAlloc(&src[g], PAIR_BYTES));
    CK(cu->cuMemAlloc(&dst[g], PAIR_BYTES));
    CK(cu->cuMemsetD8(src[g], 0x5a, PAIR_BYTES));
    CK(cu->cuStreamCreate(&st[g], CU_STREAM_NON_BLOCKING));
    CK(cu->cuEventCreate(&e0[g], CU_EVENT_DEFAULT));
    CK(cu->cuEventCreate(&e1[g], CU_EVENT_DEFAULT));
    CK(cu->cuCtxSynchronize());
  }
  for (int ways = 1; ways <= 2; ways++) { /* GPU g sends to GPU 1 - g, for g < ways */
    double *out = ways == 1 ? one : both;
    for (int i = -2; i < o->reps; i++) {
      for (int g = 0; g < ways; g++) {
        CK(cu->cuCtxSetCurrent(ctx[g]));
        CK(cu->cuEventRecord(e0[g], st[g]));
        CK(cu->cuMemcpyPeerAsync(dst[1 - g], ctx[1 - g], src[g], ctx[g], PAIR_BYTES, st[g]));
        CK(cu->cuEventRecord(e1[g], st[g]));
      }
      double slowest = 0;
      for (int g = 0; g < ways; g++) {
        float ms;
        CK(cu->cuCtxSetCurrent(ctx[g]));
        CK(cu->cuEventSynchronize(e1[g]));
        CK(cu->cuEventElapsedTime(&ms, e0[g], e1[g]));
        slowest = fmax(slowest, ms);
      }
      if (i >= 0)
        out[i] = slowest;
    }
  }
}

/* Measure (in a child: this process never touches CUDA) and print the pairwise figure. */
int peer_pair_report(const struct opts *o) {
  size_t sb = sizeof(struct shm) + 2 * (size_t)o->reps * sizeof(double);
  struct shm *s = mmap(NULL, sb, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (s == MAP_FAILED) {
    printf("# peer copy GPU 0 -> GPU 1: out of memory for the results\n");
    return 1;
  }
  memset(s, 0, sb);
  fflush(stdout);
  pid_t pid = fork();
  if (pid == 0) {
    g_shm = s;
    pair_measure(o, s->t, s->t + o->reps);
    _exit(0);
  }
  int st = 0;
  bool ok = pid > 0 && waitpid(pid, &st, 0) == pid && WIFEXITED(st) && WEXITSTATUS(st) == 0;
  if (!ok) {
    printf("# peer copy GPU 0 -> GPU 1: FAILED: %s\n",
           s->err[0] ? s->err : "the measuring process died");
  } else {
    double *one = s->t, *both = s->t + o->reps;
    bench_sort(one, (size_t)o->reps);
    bench_sort(both, (size_t)o->reps);
    double m1 = one[o->reps / 2], m2 = both[o->reps / 2], mb = (double)PAIR_BYTES;
    printf("# peer copy, %llu MiB by cuMemcpyPeerAsync, median of %d: GPU 0 -> GPU 1 alone "
           "%.1f GB/s (%.3f ms); both directions at once %.1f GB/s each way, %.1f GB/s together "
           "(%.3f ms)\n", PAIR_BYTES >> 20, o->reps, mb / m1 / 1e6, m1, mb / m2 / 1e6,
           2 * mb / m2 / 1e6, m2);
  }
  fflush(stdout);
  munmap(s, sb);
  return ok ? 0 : 1;
}
