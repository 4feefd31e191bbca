/*
 * opsworld.h — helpers for check_ops.c: a world of rank processes sharing
 * memfd slabs, random inputs from a printed (and replayable) seed, the
 * oracle's expected outputs for them, and comparisons that say what
 * differs.  Prefix ow_ (as testutil's tu_).
 */
#ifndef DEP_OPSWORLD_H
#define DEP_OPSWORLD_H

#include <stddef.h>
#include <stdint.h>

#include "host_ops.h"
#include "ref.h"

/* The largest world a test runs: the jobs of check_bigworld.c, over nodes
 * of at most DEP_MAX_LOCAL_RANKS ranks each (check_ops' worlds are 8 at most). */
#define OW_MAXW 128
#define OW_MSG 700
#define OW_TIMEOUT_MS 10000u /* generous: 8 ranks on 2 cores under ASan */
/* Room for every rank's failure, one line each: "\n  rank R (how): its message". */
#define OW_FAILS_LEN (OW_MAXW * (OW_MSG + 40))
/*
 * The end of a world's run: none of its ranks failed, else the test fails
 * with how many did, what each said (fails) and the seed that replays the
 * run.  A macro, so that the failure names the caller's line.
 */
#define OW_ASSERT_NONE_FAILED(what, nfailed, fails)                                   \
  ck_assert_msg((nfailed) == 0, "%s: %d rank(s) failed (DEP_TEST_SEED=%llu):%s", (what), \
                (nfailed), (unsigned long long)ow_seed, (fails))

/* The run's seed: $DEP_TEST_SEED, else fresh; salt varies it per loop test. */
extern uint64_t ow_seed;
void ow_seed_init(uint64_t salt);
uint64_t ow_rnd(void);
uint32_t ow_below(uint32_t n);
float ow_unif(void); /* [0, 1) */

/* Every rank's slab in one shared memfd, and a failure message per rank. */
struct ow_world {
  uint32_t n;
  uint32_t chunk; /* the layout's chunk_rows */
  struct dep_slab_layout lay;
  size_t slab_bytes, map_bytes;
  uint8_t *map;
  uint8_t *slabs[DEP_MAX_LOCAL_RANKS];
  char *msg; /* shared: one failure message per rank */
};

/* What a rank process runs: 0, or 1 with a message in msg (OW_MSG bytes). */
typedef int (*ow_rank_fn)(struct ops_ctx *c, void *arg, char *msg);

/* How topk_idx is drawn, and how many tokens each rank has. */
enum ow_pattern { P_RANDOM, P_DUP, P_ONE_RANK, P_NONE, P_ONE_EXPERT };

enum ow_tokens { T_MAX, T_ZERO, T_ONE, T_MIXED };

struct ow_scenario {
  uint32_t world, hidden, topk, experts, max_tokens, max_ll;
  int pattern, tokens, itype, fp8;
};

/* One call's inputs on every rank and the oracle's answers. */
struct ow_case {
  struct ow_scenario sc;
  struct dep_job_shape shape;
  uint32_t le, max_ll, rows_ll;
  char desc[200];
  uint8_t masked[OW_MAXW]; /* the ranks the oracle has masked (ow_case_mask) */
  struct ref_rank_in in[OW_MAXW], in_ll[OW_MAXW];
  void *idx[OW_MAXW];     /* topk_idx as the call takes it (int32 or int64) */
  uint16_t *cx[OW_MAXW];  /* combine input: one vector per received row */
  uint16_t *lx[OW_MAXW];  /* LL combine input; rows past the count hold NaN */
  struct ref_dispatch_out disp[OW_MAXW];
  struct ref_sum comb[OW_MAXW];
  struct ref_ll_out ll[OW_MAXW];
  struct ref_sum llc[OW_MAXW];
};

/* One rank's output buffers, sized for the job's capacity. */
struct ow_outs {
  int32_t *tpr, *tpe;
  uint8_t *tir;
  uint16_t *rx, *out, *lout;
  int32_t *ridx, *cnt, *lcnt, *lsrc;
  float *rw, *lscales;
  uint8_t *lx;
  int64_t *lrange; /* [le, world]: with lsrc [le, rows_ll], dep_ll_handle_info's outputs */
  uint32_t num_recv;
  size_t rows_tp, n_lx, n_ls;
  struct dep_handle h;
};

void ow_world_open(struct ow_world *w, const struct dep_job_shape *s, uint32_t n, uint32_t chunk);
void ow_world_close(struct ow_world *w);

/* Open a world of n ranks of shape s and fork one process per rank, each
 * with its own ctx (OW_TIMEOUT_MS) on the shared slabs; the test fails,
 * with every failing rank's message and the seed, unless all ranks return
 * 0.  Once one fails the others are stopped.  The world is closed after. */
void ow_run_ranks(const struct dep_job_shape *s, uint32_t n, ow_rank_fn fn, void *arg,
                  const char *what);
/* The same for a job that streams in chunks of chunk rows (slab.h). */
void ow_run_ranks_chunked(const struct dep_job_shape *s, uint32_t n, uint32_t chunk, ow_rank_fn fn,
                          void *arg, const char *what);

int ow_fail(char *msg, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Draw inputs for a scenario and compute the oracle's outputs. */
void ow_case_make(struct ow_case *d, const struct ow_scenario *sc, int fp8);
void ow_case_free(struct ow_case *d);
/* The oracle's outputs again, as with the ranks r where masked[r] is nonzero masked
 * (ref_mask); the inputs the ranks pass stay as they are. */
void ow_case_mask(struct ow_case *d, const uint8_t *masked);

void ow_outs_alloc(struct ow_outs *o, const struct ow_case *d);
void ow_outs_free(struct ow_outs *o);

uint64_t ow_fnv(uint64_t hsh, const void *p, size_t n);
/* The first byte in [p, p+n) that is not the poison, or -1. */
long ow_unpoisoned(const void *p, size_t n, uint8_t poison);
/* got (bf16) within 2^-8 |sum| + 2^-16 sum|terms| of the oracle's float64
 * sum: bf16 rounding plus float32 accumulation error, far below a wrong
 * term.  0, or 1 with a message. */
/* dep_ll_handle_info's outputs for rank r's LL dispatch of case d against the
 * oracle's rows: each valid row's source token, -1 past the count, and each
 * source's (begin, count) tiling the expert's rows in source order.  0, or 1
 * with a message. */
int ow_check_ll_info(const struct ow_case *d, uint32_t r, const int32_t *src,
                     const int64_t *range, char *msg);
int ow_check_sum(const uint16_t *got, const struct ref_sum *want, uint32_t ntok, uint32_t h,
                 const char *op, const char *desc, char *msg);
/* What a combine of d's vectors gives rank o, bit for bit (deepep.h dep_combine_args):
 * per token and channel, in float32, b0 + b1 (a NULL one +0; each bf16 [num_tokens,
 * hidden] of rank o), then each receiving rank's vector, ranks ascending, rounded once
 * to bf16 into want [num_tokens, hidden]; acc is scratch of hidden floats. */
void ow_want_combine(const struct ow_case *d, uint32_t o, const uint16_t *b0,
                     const uint16_t *b1, uint16_t *want, float *acc);

/* A small two-rank scenario for the refusal tests. */
extern const struct ow_scenario ow_small;
/* ow_run_ranks with a case of ow_small (seed salt 0, no FP8) as the ranks' arg. */
void ow_run_small(ow_rank_fn fn, const char *what);

/* Rank 0 of a world of sc->world, in the test's own process, for tests
 * that make one rank's calls themselves: the scenario's inputs and the
 * oracle's answers (seed salt 0, no FP8), every rank's slab, rank 0's ctx
 * on them and its output buffers. */
struct ow_rank0 {
  struct ow_case d;
  struct ow_world w;
  struct ops_ctx c;
  struct ow_outs o;
};
/* A new one, its ctx with op timeout timeout_ms; the test fails if it does
 * not open.  Allocated: a case is too large for a test's stack. */
struct ow_rank0 *ow_rank0_open(const struct ow_scenario *sc, uint32_t timeout_ms);
/* The same for a job that streams in chunks of chunk rows (slab.h). */
struct ow_rank0 *ow_rank0_open_chunked(const struct ow_scenario *sc, uint32_t chunk,
                                       uint32_t timeout_ms);
/* Closes all that ow_rank0_open opened and frees r. */
void ow_rank0_close(struct ow_rank0 *r);

/* dispatch of d's inputs for c's rank into o with handle h (no checks). */
int ow_dispatch(struct ops_ctx *c, const struct ow_case *d, struct ow_outs *o,
                struct dep_handle *h);
/* ll_dispatch of d's low-latency inputs for c's rank into o (its handle
 * o->h), FP8 when fp8 (no checks). */
int ow_ll_dispatch(struct ops_ctx *c, const struct ow_case *d, struct ow_outs *o, int fp8);
/* 1 when n bytes at p are all zero. */
int ow_all_zero(const uint8_t *p, size_t n);
/* One throughput round (dispatch, then combine) against the oracle, outputs
 * poisoned with pz first, the moved bytes folded into *dig; 0, or 1 with msg. */
int ow_round_tp(struct ops_ctx *c, const struct ow_case *d, struct ow_outs *o, uint8_t pz,
                uint64_t *dig, char *msg);
/* One low-latency round (dispatch, handle info, combine) against the oracle, FP8 as
 * d->sc.fp8 says, outputs poisoned with pz first; 0, or 1 with msg. */
int ow_round_ll(struct ops_ctx *c, const struct ow_case *d, struct ow_outs *o, uint8_t pz,
                uint64_t *dig, char *msg);
/* In a test holding a struct ow_rank0 *r that has made no call: refused
 * with DEP_ERR_INVALID, a message naming the argument, no seq used, and
 * every slab byte as before (zero). */
#define OW_REFUSED(call, name)                                                                     \
  do {                                                                                             \
    r->c.why[0] = 0;                                                                               \
    int rc_ = (call);                                                                              \
    ck_assert_msg(rc_ == DEP_ERR_INVALID, "%s: %s (%s)", #call, dep_errname(rc_), r->c.why);       \
    ck_assert_msg(strstr(r->c.why, name) != NULL, "%s: message \"%s\" does not name \"%s\"",       \
                  #call, r->c.why, name);                                                          \
    ck_assert_msg(ow_all_zero(r->w.map, r->w.map_bytes), "%s wrote to a slab", #call);             \
    ck_assert_uint_eq(r->c.seq, 0);                                                                \
  } while (0)

#endif /* DEP_OPSWORLD_H */
