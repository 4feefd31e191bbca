/*
 * ep.h — what the parts of the dispatch/combine benchmark share (bench/ep.c:
 * the driver and the report; rank.c: one rank; ceiling.c: the copy
 * ceilings).  The method is described at the top of bench/ep.c.
 */
#ifndef DEP_BENCH_EP_H
#define DEP_BENCH_EP_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "cudadrv.h"
#include "deepep.h"

#define MAX_RANKS 8
#define MAX_CALLS 10000
#define BARRIER_TIMEOUT_S 300.0
#define MAX_NODES 4

enum { OP_D, OP_C, OP_LLD, OP_LLC, OP_LLD8, OP_LLC8, NOPS };
extern const char *const op_name[NOPS];

struct opts {
  const char *sock, *sock_nowarm, *raw;
  /* -s SOCK,SOCK,...: one daemon per node; rank r on node r / (n / nodes). */
  const char *node_sock[MAX_NODES];
  int nodes;
  int counts[8], ncounts;
  bool modes[2]; /* [0] processes, [1] threads */
  bool first_only; /* -F: only attach and the first calls */
  bool pairs[3];   /* -p: the pairs timed after the first calls: tp, ll, ll8 (default all) */
  bool retouch;    /* -T: each op's outputs rewritten just before its first call */
  int gap_ms;      /* -G: each rank's pause between dep_attach and its first call */
  int idle_ms;     /* -I: each rank's pause before every pair, warm-up and timed */
  int stats_pairs; /* -P N: N worlds with the stats page off, N with it on, alternating */
  int calls, warm, reps;
  int gpus_want; /* -g: 0 means every visible GPU */
  int gpus;      /* ranks spread over this many GPUs: rank r on GPU r % gpus (cuda) */
  bool peer;     /* ranks on several GPUs: the ceiling is the peer copy */
  uint64_t seed;
  struct dep_job_shape shape;
};

/* What the ranks of one world share: a barrier, the first failure, results. */
struct shm {
  _Atomic unsigned bar_count, bar_gen;
  _Atomic int failed;
  double t_release;
  char err[512];
  double attach_ms[MAX_RANKS];
  double first[MAX_RANKS][NOPS];
  uint64_t bytes[MAX_RANKS][NOPS][MAX_RANKS]; /* [source][op][destination], per call */
  double t[]; /* calls: [rank][op][calls], then copies: [rank][op][reps] */
};

/* The bytes rank r sends in one call of op, to every rank (itself included). */
static inline uint64_t rank_bytes(const struct shm *s, int r, int op, int n) {
  uint64_t b = 0;
  for (int d = 0; d < n; d++)
    b += s->bytes[r][op][d];
  return b;
}

/* Whether op's pair (dispatch then combine, of tp, ll or ll8) is timed (-p). */
static inline bool op_timed(const struct opts *o, int op) { return o->pairs[op / 2]; }

/* The node of rank r in a world of n ranks spread over o->nodes nodes in equal blocks. */
static inline int rank_node(const struct opts *o, int r, int n) { return r / (n / o->nodes); }

/*
 * With several nodes, what op moves between them per call: the bytes of the
 * busiest direction from one node to another (*busiest), and the smallest
 * remote byte count of any rank (*least: its bytes for ranks on other nodes).
 */
static inline void xnode_bytes(const struct opts *o, const struct shm *s, int op, int n,
                               uint64_t *busiest, uint64_t *least) {
  uint64_t dir[MAX_NODES][MAX_NODES] = {{0}};
  *least = UINT64_MAX;
  for (int r = 0; r < n; r++) {
    uint64_t mine = 0;
    for (int d = 0; d < n; d++)
      if (rank_node(o, r, n) != rank_node(o, d, n)) {
        dir[rank_node(o, r, n)][rank_node(o, d, n)] += s->bytes[r][op][d];
        mine += s->bytes[r][op][d];
      }
    *least = mine < *least ? mine : *least;
  }
  *busiest = 0;
  for (int a = 0; a < o->nodes; a++)
    for (int b = 0; b < o->nodes; b++)
      *busiest = dir[a][b] > *busiest ? dir[a][b] : *busiest;
}

/* ---- one rank (rank.c) ---------------------------------------------------- */

struct rank {
  const struct opts *o;
  struct shm *s;
  int r, n;
  bool cuda, first_only;
  const char *sock, *job;
  dep_client_t *c;
  dep_handle_t *htp, *hll;
  CUdevice dev; /* this rank's GPU: r % gpus */
  CUcontext ctx;
  CUstream st;
  CUevent e0, e1;
  uint32_t le, llrows, num_recv, exp_recv;
  uint16_t *hx;     /* host copy of x */
  int64_t *hidx;    /* host copy of topk_idx */
  float *hw;        /* host copy of topk_weights */
  uint8_t *mult;    /* per token: ranks that receive it */
  int32_t *exp_tp;  /* per local expert: (row, k) pairs naming it */
  int32_t *exp_ll;  /* per local expert: LL rows */
  /* Buffers of the backend (host or device memory). */
  void *x, *idx, *w, *rx, *ridx, *rw, *rcnt, *out, *llrx, *llrx8, *llsc, *llcnt, *llout;
};

extern const struct cudadrv *cu; /* the driver, through the seam (cudadrv.h) */
extern struct shm *g_shm;        /* the world's shared state, for fail() */

/* Record the world's first failure (printf-style) and end this rank. */
void fail(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));

#define CK(call)                                                                  \
  do {                                                                            \
    CUresult r_ = (call);                                                         \
    if (r_ != CUDA_SUCCESS)                                                       \
      fail("%s failed: %s", #call, cudadrv_errstr(r_));                           \
  } while (0)

void cuda_load(void);
/* The rank's buffers: device memory on cuda, host memory on the host backend. */
void *balloc(struct rank *k, size_t n);
void bfree(struct rank *k, void *p);
void upload(struct rank *k, void *dst, const void *src, size_t n);
/* A bounded barrier over the world; returns the time the last rank arrived. */
double bar_wait(struct rank *k);
/* Where rank k's copy-ceiling times of op go in the shared results. */
double *tcopy(struct rank *k, int op);
/* Attach, check, time every op and the ceiling (one rank process or thread). */
void rank_run(struct rank *k);
void *rank_thread(void *arg);

/* ---- the ceilings (ceiling.c) --------------------------------------------- */

/* Every rank on one GPU (or the host backend): each copies its own bytes of each op. */
void copy_ceiling(struct rank *k);
/* Ranks on several GPUs: each op's traffic done by peer copies. */
void peer_copy_ceiling(struct rank *k);
/* Print the GPU 0 -> GPU 1 peer copy rate, alone and both ways (from a child process). */
int peer_pair_report(const struct opts *o);

#endif /* DEP_BENCH_EP_H */
