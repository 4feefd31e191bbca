/*
 * check_ops_split.c — the host backend's split low-latency calls (deepep.h
 * "Split calls", DEP_LL_SEND and DEP_LL_RECV) in real rank processes: a
 * split dispatch and combine give the whole calls' outputs bit for bit
 * (bf16 and FP8) while the sender overwrites its inputs between send and
 * receive; two micro-batches interleave (send A, send B, receive A,
 * receive B) on every rank; a rank that has received two calls ahead of a
 * peer waits for the peer's receive before it reuses the slots (and, in an
 * elastic job, stops waiting once that peer is killed and masked); and
 * every invalid sequence is refused naming phases, the job usable after.
 *
 * Inputs are fresh random data each run; a failure prints the seed, and
 * DEP_TEST_SEED=<seed> replays it.
 */
#include <check.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <stdatomic.h>
#include <sys/mman.h>
#include <sys/wait.h>

#include "daemonwire.h"
#include "host_ops.h"
#include "nodes.h"
#include "opsworld.h"
#include "xnjob.h"
#include "xnround.h"

#define SPLIT_POISON 0xA5

#define RUN(expr, what)                                                                       \
  do {                                                                                        \
    int rc_ = (expr);                                                                         \
    if (rc_ != 0)                                                                             \
      return ow_fail(msg, "%s: %s: %s", (what), dep_errname(rc_), c->why);                    \
  } while (0)

/* A call's own copies of a rank's LL inputs, which the test overwrites after the send. */
struct split_in {
  uint16_t *x, *lx;
  void *idx;
  size_t nx, nlx, nidx;
};

static void split_in_make(struct split_in *s, const struct ow_case *d, uint32_t r) {
  const uint32_t n = d->in_ll[r].num_tokens, h = d->sc.hidden;
  s->nx = (size_t)n * h * 2 + 2;
  s->nlx = (size_t)d->le * d->rows_ll * h * 2;
  s->nidx = (size_t)n * d->sc.topk * (d->sc.itype == DEP_INDEX_I64 ? 8 : 4) + 8;
  s->x = malloc(s->nx);
  s->lx = malloc(s->nlx);
  s->idx = malloc(s->nidx);
  ck_assert(s->x && s->lx && s->idx);
  memcpy(s->x, d->in_ll[r].x, s->nx - 2);
  memcpy(s->lx, d->lx[r], s->nlx);
  memcpy(s->idx, d->idx[r], s->nidx - 8);
}

static void split_in_free(struct split_in *s) { free(s->x), free(s->lx), free(s->idx); }

/* The split dispatch's and combine's arguments on the inputs of s, into o. */
static struct dep_ll_dispatch_args split_da(const struct ow_case *d, uint32_t r,
                                            const struct split_in *s, struct ow_outs *o,
                                            uint32_t phases) {
  return (struct dep_ll_dispatch_args){sizeof(struct dep_ll_dispatch_args), s->x, s->idx,
                                       d->sc.itype, d->in_ll[r].num_tokens, d->sc.fp8, o->lx,
                                       d->sc.fp8 ? o->lscales : NULL, o->lcnt, phases, NULL};
}

static struct dep_ll_combine_args split_ca(const struct ow_case *d, uint32_t r,
                                           const struct split_in *s, struct ow_outs *o,
                                           uint32_t phases) {
  return (struct dep_ll_combine_args){sizeof(struct dep_ll_combine_args), s->lx, d->idx[r],
                                      d->sc.itype, d->in_ll[r].topk_weights, o->lout, phases, NULL};
}

static void split_poison(const struct ow_case *d, struct ow_outs *o) {
  memset(o->lx, SPLIT_POISON, o->n_lx * (d->sc.fp8 ? 1 : 2));
  memset(o->lscales, SPLIT_POISON, o->n_ls * 4);
  memset(o->lcnt, SPLIT_POISON, d->le * 4);
  memset(o->lout, SPLIT_POISON, (size_t)d->max_ll * d->sc.hidden * 2);
}

/* The split call's outputs are the whole call's, byte for byte (poison where unwritten). */
static int split_same(const struct ow_case *d, const struct ow_outs *whole,
                      const struct ow_outs *split, const char *what, char *msg) {
  const struct {
    const void *a, *b;
    size_t n;
    const char *name;
  } cmp[] = {{whole->lx, split->lx, whole->n_lx * (d->sc.fp8 ? 1 : 2), "recv_x"},
             {whole->lscales, split->lscales, whole->n_ls * 4, "recv_scales"},
             {whole->lcnt, split->lcnt, d->le * 4, "recv_count"},
             {whole->lout, split->lout, (size_t)d->max_ll * d->sc.hidden * 2, "out"}};
  for (size_t i = 0; i < sizeof cmp / sizeof cmp[0]; i++)
    if (memcmp(cmp[i].a, cmp[i].b, cmp[i].n) != 0)
      return ow_fail(msg, "%s: %s differs from the whole call's [%s]", what, cmp[i].name,
                     d->desc);
  return 0;
}

/* One LL round of d made whole into o (against the oracle, ow_round_ll), poisoned first. */
static int split_whole(struct ops_ctx *c, const struct ow_case *d, struct ow_outs *o, char *msg) {
  uint64_t dig = 0;
  split_poison(d, o);
  return ow_round_ll(c, d, o, SPLIT_POISON, &dig, msg);
}

/* ---- split equals whole ----------------------------------------------------------- */

/*
 * Each rank makes the round whole, then split: it sends the dispatch,
 * overwrites x and topk_idx (DeepEP lets the caller write them once the
 * send returns), receives; sends the combine, overwrites its x, receives.
 * The outputs are the whole round's, byte for byte.
 */
static int split_equal_rank(struct ops_ctx *c, void *arg, char *msg) {
  const struct ow_case *d = arg;
  const uint32_t r = c->rank;
  struct ow_outs whole, split;
  ow_outs_alloc(&whole, d);
  ow_outs_alloc(&split, d);
  struct split_in s;
  split_in_make(&s, d, r);
  int rc = split_whole(c, d, &whole, msg);
  if (rc == 0) {
    split_poison(d, &split);
    struct dep_ll_dispatch_args da = split_da(d, r, &s, &split, DEP_LL_SEND);
    rc = host_ops_ll_dispatch(c, &da, &split.h);
    memset(s.x, 0xFF, s.nx), memset(s.idx, 0x7F, s.nidx); /* NaNs and ids out of range */
    da.phases = DEP_LL_RECV;
    if (rc == 0)
      rc = host_ops_ll_dispatch(c, &da, &split.h);
    struct dep_ll_combine_args ca = split_ca(d, r, &s, &split, DEP_LL_SEND);
    if (rc == 0)
      rc = host_ops_ll_combine(c, &ca, &split.h);
    memset(s.lx, 0xFF, s.nlx);
    ca.phases = DEP_LL_RECV;
    if (rc == 0)
      rc = host_ops_ll_combine(c, &ca, &split.h);
    if (rc != 0)
      rc = ow_fail(msg, "split call: %s: %s", dep_errname(rc), c->why);
    else if (c->seq != 4)
      rc = ow_fail(msg, "seq %llu after two whole and two split calls, want 4",
                   (unsigned long long)c->seq);
    else
      rc = split_same(d, &whole, &split, "split round", msg);
  }
  split_in_free(&s);
  ow_outs_free(&whole);
  ow_outs_free(&split);
  return rc;
}

static const struct ow_scenario split_scenarios[] = {
  /* world hidden topk experts max_tokens max_ll  routing  tokens  index  fp8 */
  {2, 256, 4, 8, 16, 16, P_RANDOM, T_MAX, DEP_INDEX_I64, 0},
  {2, 256, 4, 8, 16, 16, P_DUP, T_MIXED, DEP_INDEX_I32, 1},
  {4, 384, 8, 16, 16, 8, P_RANDOM, T_MIXED, DEP_INDEX_I64, 1},
  {4, 128, 2, 8, 16, 8, P_ONE_RANK, T_ZERO, DEP_INDEX_I32, 0},
};

#define N_SPLIT_SCENARIOS (int)(sizeof split_scenarios / sizeof split_scenarios[0])

START_TEST(split_calls_equal_whole_calls_bit_for_bit) {
  ow_seed_init(300 + (uint64_t)_i);
  struct ow_case *d = malloc(sizeof *d);
  ck_assert_ptr_nonnull(d);
  ow_case_make(d, &split_scenarios[_i], split_scenarios[_i].fp8);
  ow_run_ranks(&d->shape, d->sc.world, split_equal_rank, d, d->desc);
  ow_case_free(d);
  free(d);
}
END_TEST

/* ---- two micro-batches --------------------------------------------------------------- */

/* Two cases of one shape (A bf16, B FP8 where the scenario says FP8). */
struct split_pair {
  struct ow_case a, b;
};

/*
 * Whole rounds of A and B first (against the oracle), then on every rank:
 * send A's dispatch, send B's, receive A, receive B; send A's combine,
 * send B's, receive A, receive B; then a whole round of A again.  The
 * split outputs are the whole ones, byte for byte.
 */
static int split_pair_rank(struct ops_ctx *c, void *arg, char *msg) {
  struct split_pair *p = arg;
  const struct ow_case *d[2] = {&p->a, &p->b};
  const uint32_t r = c->rank;
  struct ow_outs whole[2], split[2];
  struct split_in s[2];
  for (int i = 0; i < 2; i++) {
    ow_outs_alloc(&whole[i], d[i]);
    ow_outs_alloc(&split[i], d[i]);
    split_in_make(&s[i], d[i], r);
  }
  int rc = split_whole(c, d[0], &whole[0], msg) || split_whole(c, d[1], &whole[1], msg);
  for (int i = 0; rc == 0 && i < 2; i++) {
    split_poison(d[i], &split[i]);
    struct dep_ll_dispatch_args da = split_da(d[i], r, &s[i], &split[i], DEP_LL_SEND);
    RUN(host_ops_ll_dispatch(c, &da, &split[i].h), i ? "send B" : "send A");
    memset(s[i].x, 0xFF, s[i].nx);
  }
  for (int i = 0; rc == 0 && i < 2; i++) {
    struct dep_ll_dispatch_args da = split_da(d[i], r, &s[i], &split[i], DEP_LL_RECV);
    RUN(host_ops_ll_dispatch(c, &da, &split[i].h), i ? "receive B" : "receive A");
  }
  for (int i = 0; rc == 0 && i < 2; i++) {
    struct dep_ll_combine_args ca = split_ca(d[i], r, &s[i], &split[i], DEP_LL_SEND);
    RUN(host_ops_ll_combine(c, &ca, &split[i].h), i ? "combine send B" : "combine send A");
    memset(s[i].lx, 0xFF, s[i].nlx);
  }
  for (int i = 0; rc == 0 && i < 2; i++) {
    struct dep_ll_combine_args ca = split_ca(d[i], r, &s[i], &split[i], DEP_LL_RECV);
    RUN(host_ops_ll_combine(c, &ca, &split[i].h), i ? "combine receive B" : "combine receive A");
  }
  for (int i = 0; rc == 0 && i < 2; i++)
    rc = split_same(d[i], &whole[i], &split[i], i ? "micro-batch B" : "micro-batch A", msg);
  if (rc == 0)
    rc = split_whole(c, d[0], &whole[0], msg); /* whole calls go on after split ones */
  if (rc == 0 && c->seq != 10)
    rc = ow_fail(msg, "seq %llu after 10 calls", (unsigned long long)c->seq);
  for (int i = 0; i < 2; i++) {
    split_in_free(&s[i]);
    ow_outs_free(&whole[i]);
    ow_outs_free(&split[i]);
  }
  return rc;
}

START_TEST(two_micro_batches_interleave_on_every_rank) {
  ow_seed_init(310 + (uint64_t)_i);
  struct split_pair *p = malloc(sizeof *p);
  ck_assert_ptr_nonnull(p);
  struct ow_scenario a = split_scenarios[_i], b = a;
  a.fp8 = 0;
  ow_case_make(&p->a, &a, 0);
  ow_case_make(&p->b, &b, b.fp8);
  ow_run_ranks(&p->a.shape, a.world, split_pair_rank, p, p->b.desc);
  ow_case_free(&p->a);
  ow_case_free(&p->b);
  free(p);
}
END_TEST

/* ---- a receiver two calls behind ------------------------------------------------------ */

/*
 * Rank 1 sends calls 1 and 2 (dispatches of A and B) and then waits on a
 * pipe; rank 0 sends both, receives both (rank 1's rows are there), says
 * so on the pipe, and makes call 3, a whole dispatch of A, whose slots are
 * call 1's in rank 1's slab, unread.  Rank 0's call must wait for rank 1 to
 * receive call 1 (the old code overwrote it: rank 1's receive then found
 * rank 0 at call 3, DEP_ERR_MISMATCH).  Both ranks then check every output.
 */
struct split_behind {
  struct split_pair p;
  int fd[2];
};

/* The inputs of micro-batches A and B (s) and the outputs of calls A, B, A (o) of rank r. */
static void behind_make(const struct ow_case *const d[2], uint32_t r, struct split_in s[2],
                        struct ow_outs o[3]) {
  for (int i = 0; i < 2; i++)
    split_in_make(&s[i], d[i], r);
  for (int i = 0; i < 3; i++)
    ow_outs_alloc(&o[i], d[i % 2]);
}

/* Whether call `call`'s low-latency rows (o, of case d) on rank r are the oracle's. */
static int behind_rows_ok(const struct ow_case *d, const struct ow_outs *o, uint32_t r,
                          int call, char *msg) {
  const struct ref_ll_out *e = &d->ll[r];
  const size_t h = d->sc.hidden;
  for (uint32_t l = 0; l < d->le; l++)
    if (o->lcnt[l] != e->count[l] ||
        memcmp((const uint16_t *)o->lx + (size_t)l * d->rows_ll * h, e->x + (size_t)l * d->rows_ll * h,
               (size_t)e->count[l] * h * 2) != 0)
      return ow_fail(msg, "call %d: expert %u's rows are not the oracle's", call, l);
  return 0;
}

static int split_behind_rank(struct ops_ctx *c, void *arg, char *msg) {
  struct split_behind *b = arg;
  const struct ow_case *d[2] = {&b->p.a, &b->p.b};
  const uint32_t r = c->rank;
  struct ow_outs o[3];
  struct split_in s[2];
  behind_make(d, r, s, o);
  for (int i = 0; i < 3; i++)
    split_poison(d[i % 2], &o[i]);
  int rc = 0;
  char byte = 1;
  for (int i = 0; rc == 0 && i < 2; i++) {
    struct dep_ll_dispatch_args da = split_da(d[i], r, &s[i], &o[i], DEP_LL_SEND);
    RUN(host_ops_ll_dispatch(c, &da, &o[i].h), "send");
  }
  if (r == 1 && read(b->fd[0], &byte, 1) != 1)
    rc = ow_fail(msg, "the pipe from rank 0 closed");
  for (int i = 0; rc == 0 && i < 2; i++) {
    struct dep_ll_dispatch_args da = split_da(d[i], r, &s[i], &o[i], DEP_LL_RECV);
    RUN(host_ops_ll_dispatch(c, &da, &o[i].h), "receive");
  }
  if (rc == 0 && r == 0 && write(b->fd[1], &byte, 1) != 1)
    rc = ow_fail(msg, "the pipe to rank 1 failed");
  if (rc == 0)
    RUN(ow_ll_dispatch(c, d[0], &o[2], 0), "whole dispatch, call 3");
  /* Each dispatch's rows are the oracle's: call 1 and call 3 (A) alike, call 2 (B). */
  for (int i = 0; rc == 0 && i < 3; i++)
    rc = behind_rows_ok(d[i % 2], &o[i], r, i + 1, msg);
  for (int i = 0; i < 2; i++)
    split_in_free(&s[i]);
  for (int i = 0; i < 3; i++)
    ow_outs_free(&o[i]);
  return rc;
}

/* Two micro-batches' cases of the first scenario and a pipe between the ranks, for a body
 * in which one rank falls behind the others. */
static void run_behind(uint64_t seed, ow_rank_fn body, const char *what) {
  ow_seed_init(seed);
  struct split_behind *b = malloc(sizeof *b);
  ck_assert_ptr_nonnull(b);
  struct ow_scenario sc = split_scenarios[0];
  ow_case_make(&b->p.a, &sc, 0);
  ow_case_make(&b->p.b, &sc, 0);
  ck_assert_int_eq(pipe(b->fd), 0);
  ow_run_ranks(&b->p.a.shape, sc.world, body, b, what);
  close(b->fd[0]), close(b->fd[1]);
  ow_case_free(&b->p.a);
  ow_case_free(&b->p.b);
  free(b);
}

START_TEST(a_call_waits_for_a_peer_two_receives_behind) {
  run_behind(320, split_behind_rank, "a receiver two calls behind");
}
END_TEST

/*
 * A peer that never receives: rank 1 sends calls 1 and 2 and waits on the
 * pipe; rank 0 sends and receives both, and its call 3 waits for rank 1 to
 * read call 1, which it does not: DEP_ERR_TIMEOUT after the op timeout
 * (OW_TIMEOUT_MS, the bound of every wait), naming rank 1 and call 1, its
 * context broken; rank 1's rows of call 1 were not overwritten (it then
 * receives both calls, told by the pipe, and checks them).
 */
static int split_stuck_rank(struct ops_ctx *c, void *arg, char *msg) {
  struct split_behind *b = arg;
  const struct ow_case *d[2] = {&b->p.a, &b->p.b};
  const uint32_t r = c->rank;
  struct ow_outs o[3];
  struct split_in s[2];
  behind_make(d, r, s, o);
  char byte = 1;
  for (int i = 0; i < 2; i++) {
    struct dep_ll_dispatch_args da = split_da(d[i], r, &s[i], &o[i], DEP_LL_SEND);
    RUN(host_ops_ll_dispatch(c, &da, &o[i].h), "send");
  }
  if (r == 1 && read(b->fd[0], &byte, 1) != 1)
    return ow_fail(msg, "the pipe from rank 0 closed");
  for (int i = 0; i < 2; i++) {
    struct dep_ll_dispatch_args da = split_da(d[i], r, &s[i], &o[i], DEP_LL_RECV);
    RUN(host_ops_ll_dispatch(c, &da, &o[i].h), "receive");
  }
  int rc = 0;
  if (r == 0) {
    c->why[0] = 0;
    const int got = ow_ll_dispatch(c, d[0], &o[2], 0);
    if (got != DEP_ERR_TIMEOUT || strstr(c->why, "rank 1 has not read call 1") == NULL ||
        !c->broken)
      rc = ow_fail(msg, "call 3 with rank 1 stuck before its receives: %s (%s), broken %d; "
                   "want DEP_ERR_TIMEOUT naming rank 1 and call 1, broken", dep_errname(got),
                   c->why, c->broken);
    if (write(b->fd[1], &byte, 1) != 1)
      rc = ow_fail(msg, "the pipe to rank 1 failed");
  }
  for (int i = 0; rc == 0 && i < 2; i++)
    rc = behind_rows_ok(d[i], &o[i], r, i + 1, msg);
  return rc;
}

START_TEST(a_peer_that_never_receives_times_the_next_call_out_unoverwritten) {
  run_behind(325, split_stuck_rank, "a peer that never receives");
}
END_TEST

/* ---- invalid sequences ---------------------------------------------------------------- */

/* Refused with DEP_ERR_INVALID naming phases and what, no seq taken. */
#define SPLIT_REFUSED(call, what)                                                              \
  do {                                                                                        \
    const uint64_t seq_ = c->seq;                                                             \
    c->why[0] = 0;                                                                            \
    int rc_ = (call);                                                                         \
    if (rc_ != DEP_ERR_INVALID || strstr(c->why, "phases") == NULL ||                         \
        strstr(c->why, (what)) == NULL || c->seq != seq_)                                     \
      return ow_fail(msg, "%s: %s (%s), seq %llu; want DEP_ERR_INVALID naming phases and "    \
                     "\"%s\", seq %llu", #call, dep_errname(rc_), c->why,                     \
                     (unsigned long long)c->seq, (what), (unsigned long long)seq_);           \
  } while (0)

/*
 * On every rank: a receive with no send; phases 4; then send A; a second
 * send into A's handle, a combine of it, and a receive of a combine with it
 * are refused; send B; a third send (C) is refused (its parity's slots are
 * A's); a receive with another num_tokens is refused; then receive A and B,
 * combine both whole, and a whole round against the oracle: the job goes on.
 */
static int split_refusals_rank(struct ops_ctx *c, void *arg, char *msg) {
  struct split_pair *p = arg;
  const struct ow_case *d = &p->a;
  const uint32_t r = c->rank;
  struct ow_outs o[3];
  struct split_in s;
  split_in_make(&s, d, r);
  for (int i = 0; i < 3; i++)
    ow_outs_alloc(&o[i], d);
  int rc = 0;
  struct dep_ll_dispatch_args da = split_da(d, r, &s, &o[0], DEP_LL_RECV);
  struct dep_ll_combine_args ca = split_ca(d, r, &s, &o[0], DEP_LL_RECV);
  SPLIT_REFUSED(host_ops_ll_dispatch(c, &da, &o[0].h), "no pending send");
  da.phases = 4;
  SPLIT_REFUSED(host_ops_ll_dispatch(c, &da, &o[0].h), "phases is 4");
  ca.phases = 4;
  SPLIT_REFUSED(host_ops_ll_combine(c, &ca, &o[0].h), "phases is 4");
  da.phases = DEP_LL_SEND;
  RUN(host_ops_ll_dispatch(c, &da, &o[0].h), "send A");
  SPLIT_REFUSED(host_ops_ll_dispatch(c, &da, &o[0].h), "receive has not run");
  ca.phases = 0;
  SPLIT_REFUSED(host_ops_ll_combine(c, &ca, &o[0].h), "receive has not run");
  ca.phases = DEP_LL_RECV;
  SPLIT_REFUSED(host_ops_ll_combine(c, &ca, &o[0].h), "no pending send");
  struct dep_ll_dispatch_args db = split_da(d, r, &s, &o[1], DEP_LL_SEND);
  RUN(host_ops_ll_dispatch(c, &db, &o[1].h), "send B");
  struct dep_ll_dispatch_args dc = split_da(d, r, &s, &o[2], DEP_LL_SEND);
  SPLIT_REFUSED(host_ops_ll_dispatch(c, &dc, &o[2].h), "at most 2 calls");
  dc.phases = 0;
  SPLIT_REFUSED(host_ops_ll_dispatch(c, &dc, &o[2].h), "at most 2 calls");
  da.phases = DEP_LL_RECV;
  if (d->in_ll[r].num_tokens > 0) {
    da.num_tokens--;
    SPLIT_REFUSED(host_ops_ll_dispatch(c, &da, &o[0].h), "num_tokens");
    da.num_tokens++;
  }
  RUN(host_ops_ll_dispatch(c, &da, &o[0].h), "receive A");
  db.phases = DEP_LL_RECV;
  RUN(host_ops_ll_dispatch(c, &db, &o[1].h), "receive B");
  for (int i = 0; i < 2; i++) {
    struct dep_ll_combine_args cw = split_ca(d, r, &s, &o[i], 0);
    RUN(host_ops_ll_combine(c, &cw, &o[i].h), "whole combine");
  }
  rc = split_whole(c, d, &o[2], msg);
  split_in_free(&s);
  for (int i = 0; i < 3; i++)
    ow_outs_free(&o[i]);
  return rc;
}

START_TEST(invalid_sequences_are_refused_naming_phases_and_the_job_goes_on) {
  ow_seed_init(330);
  struct split_pair *p = malloc(sizeof *p);
  ck_assert_ptr_nonnull(p);
  ow_case_make(&p->a, &split_scenarios[2], 0);
  ow_run_ranks(&p->a.shape, p->a.sc.world, split_refusals_rank, p, "invalid split sequences");
  ow_case_free(&p->a);
  free(p);
}
END_TEST

/* ---- wait costs ----------------------------------------------------------------------- */

/* Base of the counters: what a call adds must land above it, and below it plus a bound. */
#define SPLIT_COST_BASE (1ll << 40)

/* Every counter of cost[0..W) in [lo[i], lo[i] + limit] (limit 0: equal); 0, or 1 with msg. */
static int split_costs(const int64_t *cost, const int64_t *lo, uint32_t W, int64_t limit,
                       const char *what, char *msg) {
  for (uint32_t s = 0; s < W; s++)
    if (cost[s] < lo[s] || cost[s] - lo[s] > limit)
      return ow_fail(msg, "%s: wait_cost[%u] went from %lld to %lld (at most %lld more)", what,
                     s, (long long)lo[s], (long long)cost[s], (long long)limit);
  return 0;
}

/*
 * wait_cost (DeepEP's *_wait_recv_cost_stats): a send adds nothing; a
 * receive adds each source's wait, in ns, at most the op timeout (the
 * bound on every wait: a generous ceiling, not a timing); a whole call
 * adds too, to what is there; a misaligned pointer is refused naming it.
 */
static int split_cost_rank(struct ops_ctx *c, void *arg, char *msg) {
  const struct ow_case *d = arg;
  const uint32_t r = c->rank, W = d->sc.world;
  const int64_t limit = (int64_t)OW_TIMEOUT_MS * 1000000;
  struct ow_outs o;
  ow_outs_alloc(&o, d);
  struct split_in s;
  split_in_make(&s, d, r);
  int64_t cost[2 * OW_MAXW + 1], before[2 * OW_MAXW];
  for (uint32_t i = 0; i < 2 * W; i++)
    cost[i] = SPLIT_COST_BASE;
  memcpy(before, cost, 2 * W * sizeof *cost);
  struct dep_ll_dispatch_args da = split_da(d, r, &s, &o, DEP_LL_SEND);
  struct dep_ll_combine_args ca = split_ca(d, r, &s, &o, DEP_LL_SEND);
  da.wait_cost = (int64_t *)((uint8_t *)cost + 4);
  c->why[0] = 0;
  if (host_ops_ll_dispatch(c, &da, &o.h) != DEP_ERR_INVALID || !strstr(c->why, "wait_cost"))
    return ow_fail(msg, "a misaligned wait_cost: \"%s\", want DEP_ERR_INVALID naming it", c->why);
  da.wait_cost = cost, ca.wait_cost = cost + W;
  RUN(host_ops_ll_dispatch(c, &da, &o.h), "dispatch send");
  int rc = split_costs(cost, before, 2 * W, 0, "a dispatch's send", msg);
  da.phases = DEP_LL_RECV;
  if (rc == 0)
    RUN(host_ops_ll_dispatch(c, &da, &o.h), "dispatch receive");
  rc = rc || split_costs(cost, before, W, limit, "a dispatch's receive", msg) ||
       split_costs(cost + W, before + W, W, 0, "a dispatch's receive (combine's counters)", msg);
  memcpy(before, cost, 2 * W * sizeof *cost);
  if (rc == 0)
    RUN(host_ops_ll_combine(c, &ca, &o.h), "combine send");
  ca.phases = DEP_LL_RECV;
  if (rc == 0)
    RUN(host_ops_ll_combine(c, &ca, &o.h), "combine receive");
  rc = rc || split_costs(cost, before, W, 0, "a combine (dispatch's counters)", msg) ||
       split_costs(cost + W, before + W, W, limit, "a combine's receive", msg);
  memcpy(before, cost, 2 * W * sizeof *cost);
  da.phases = 0;
  if (rc == 0)
    RUN(host_ops_ll_dispatch(c, &da, &o.h), "whole dispatch");
  rc = rc || split_costs(cost, before, W, limit, "a whole dispatch", msg);
  split_in_free(&s);
  ow_outs_free(&o);
  return rc;
}

START_TEST(wait_costs_are_added_by_receives_only) {
  ow_seed_init(340);
  struct ow_case *d = malloc(sizeof *d);
  ck_assert_ptr_nonnull(d);
  ow_case_make(d, &split_scenarios[2], 0);
  ow_run_ranks(&d->shape, d->sc.world, split_cost_rank, d, "wait costs");
  ow_case_free(d);
  free(d);
}
END_TEST

/* ---- across nodes ------------------------------------------------------------------- */

/*
 * Split calls in a job over two daemons (2 + 2 ranks, host backend): every
 * rank runs xn_round_split (micro-batches A and B pipelined, send 1, send
 * 2, receive 1, send 3, receive 2, ..., then as two batches, each receive
 * against the oracle), then a whole round.  Rank 0 is slow to receive
 * call 1: it waits for the test's go.  Call 3 reuses call 1's blocks, and
 * the ranks on node 1 may not post it before rank 0 has read call 1
 * (host_ops.h "Split calls").  The test says go once both have returned
 * from their send of call 3 and node 0's daemon has written every frame of
 * calls 1 to 3 from them, or after XS_EARLY_MS if they have not: with the
 * taken words they cannot have, so the test waits that ceiling out every
 * run; without them (the old protocol with only the refusal removed) they
 * return at once, and rank 0's receive of call 1 finds their call 3 in its
 * slots.
 */
#define XS_SLOW 0u         /* the slow receiver, on node 0 */
#define XS_FAR 2u          /* the first rank on node 1 */
#define XS_WORLD 4u
/* How long the test waits for the ranks on node 1 to return from call 3 early: a ceiling
 * the fixed protocol always waits out (they cannot return), not a timing it relies on; a
 * machine stalled for this long could only let the old protocol pass a run. */
#define XS_EARLY_MS 1500
/* Block frames of calls 1 to 3 from node 1 into node 0: 2 sources x 2 destinations each. */
#define XS_FRAMES_3 12ull

struct xsplit {
  struct split_pair p;
  _Atomic uint32_t *sent3; /* shared: ranks on node 1 whose send of call 3 has returned */
  _Atomic int *go;         /* shared: set by the test; rank 0 may receive call 1 */
};

/* Rank 0 waits for go before its receive of call 1 (step 2); the ranks on node 1 say
 * when their send of call 3 (step 3) has returned. */
static void xsplit_hook(uint32_t r, int step, int after, void *arg) {
  const struct xsplit *x = arg;
  if (!after && step == 2 && r == XS_SLOW) {
    const int64_t until = xn_mono_ms() + 120000; /* a test that failed first leaves no rank */
    while (!atomic_load(x->go) && xn_mono_ms() < until)
      dw_sleep_ms(2);
  }
  if (after && step == 3 && r >= XS_FAR)
    atomic_fetch_add(x->sent3, 1);
}

static int xsplit_rank(dep_client_t *c, const struct xn_run *run, uint32_t r,
                       struct xn_result *res) {
  struct xsplit *x = run->arg;
  struct ow_outs o[2];
  ow_outs_alloc(&o[0], &x->p.a);
  ow_outs_alloc(&o[1], &x->p.b);
  int rc = xn_round_split(c, &x->p.a, &x->p.b, r, o, xsplit_hook, x, res);
  if (rc == 0)
    rc = xn_round(c, &x->p.a, r, 0, &o[0], res); /* whole calls go on after split ones */
  ow_outs_free(&o[0]);
  ow_outs_free(&o[1]);
  return rc;
}

/* Node i's daemon's data frames in, from deepepctl peers (one peer). */
static unsigned long long xs_frames_in(const struct nodes *ns, int i) {
  static char out[16384];
  xn_ctl_json_at(ns, i, "peers", out, sizeof out);
  const char *p = strstr(out, "\"data_frames_in\":");
  return p != NULL ? strtoull(p + strlen("\"data_frames_in\":"), NULL, 10) : 0;
}

START_TEST(across_nodes_a_slow_receiver_is_not_overwritten) {
  ow_seed_init(340);
  struct xsplit *x = malloc(sizeof *x);
  ck_assert_ptr_nonnull(x);
  const struct ow_scenario sc = {XS_WORLD, 128, 8, 16, 32, 16, P_RANDOM, T_MAX, DEP_INDEX_I32, 0};
  ow_case_make(&x->p.a, &sc, 0);
  ow_case_make(&x->p.b, &sc, 0);
  void *shared = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  ck_assert_ptr_ne(shared, MAP_FAILED);
  memset(shared, 0, 4096);
  x->sent3 = shared;
  x->go = (_Atomic int *)((uint8_t *)shared + 64);
  struct nodes ns;
  xn_nodes_start(&ns, 2, 20000, XN_OP_TIMEOUT_MS * 4, "");
  struct xn_place pl;
  memset(&pl, 0, sizeof pl);
  const uint32_t split[NODES_MAX] = {2, 2};
  xn_place(&pl, split, 2);
  struct xn_result *res = xn_results(XS_WORLD);
  const struct xn_run run = {.d = &x->p.a, .body = xsplit_rank, .arg = x};
  pid_t pids[OW_MAXW];
  xn_spawn(&ns, &pl, "xsplit", &run, res, pids);
  int64_t until = xn_mono_ms() + XS_EARLY_MS;
  while (atomic_load(x->sent3) < XS_WORLD - XS_FAR && xn_mono_ms() < until)
    dw_sleep_ms(5);
  const bool early = atomic_load(x->sent3) == XS_WORLD - XS_FAR;
  /* Their frames of call 3 written at node 0 (a ceiling for a loaded machine). */
  until = xn_mono_ms() + 30000;
  while (early && xs_frames_in(&ns, 0) < XS_FRAMES_3 && xn_mono_ms() < until)
    dw_sleep_ms(5);
  atomic_store(x->go, 1);
  const bool ok = xn_reap(pids, XS_WORLD, 120000);
  char all[4 * OW_MSG] = "";
  for (uint32_t g = 0; g < XS_WORLD; g++)
    if (res[g].rc != 0 || !res[g].done)
      snprintf(all + strlen(all), sizeof all - strlen(all), "\n  rank %u: %s", g,
               res[g].done ? res[g].msg : "did not finish");
  nodes_stop(&ns);
  ck_assert_msg(!early, "the ranks on node 1 returned from call 3 before rank 0 read call 1, "
                "whose blocks call 3 reuses (seed %llu):%s", (unsigned long long)ow_seed, all);
  ck_assert_msg(ok, "split calls across nodes (seed %llu): ranks failed:%s",
                (unsigned long long)ow_seed, all);
  munmap(res, XS_WORLD * sizeof *res);
  munmap(shared, 4096);
  ow_case_free(&x->p.a);
  ow_case_free(&x->p.b);
  free(x);
}
END_TEST

/* ---- an elastic job: a rank that dies with a split call of its unread ---------- */

/* How long a survivor or the test waits for the others: a ceiling for a loaded CI machine,
 * not an expectation (the daemon masks a killed rank within milliseconds). */
#define ES_CEILING_MS 60000

/* Shared with the rank processes of the elastic case. */
struct es_ctl {
  _Atomic uint32_t sent;    /* the victim has sent calls 1 and 2 (and receives neither) */
  _Atomic uint32_t read;    /* survivors that have received calls 1 and 2 */
  _Atomic uint32_t killed;  /* the test has killed the victim (it was reaped) */
  struct xn_result res[OW_MAXW];
};

/* Wait (ES_CEILING_MS at most) until *w reaches want; whether it did. */
static bool es_await(_Atomic uint32_t *w, uint32_t want) {
  const int64_t until = dw_now_ms() + ES_CEILING_MS;
  while (atomic_load(w) < want) {
    if (dw_now_ms() > until)
      return false;
    dw_sleep_ms(1);
  }
  return true;
}

/* A low-latency dispatch split in two (deepep.h "Split calls"): phase DEP_LL_SEND or
 * DEP_LL_RECV of case d's inputs for rank r; a receive checked against d's oracle when
 * check says so. */
static int es_ll(dep_client_t *c, const struct ow_case *d, uint32_t r, struct ow_outs *o,
                 dep_handle_t *h, uint32_t phase, bool check, const char *what,
                 struct xn_result *res) {
  const struct ref_rank_in *il = &d->in_ll[r];
  struct dep_ll_dispatch_args a = {.size = sizeof a, .x = il->x, .topk_idx = d->idx[r],
                                   .index_type = d->sc.itype, .num_tokens = il->num_tokens,
                                   .recv_x = o->lx, .recv_count = o->lcnt, .phases = phase};
  const int rc = dep_ll_dispatch(c, &a, h, NULL);
  if (rc != 0) {
    ow_fail(res->msg, "%s: %s: %s [%s]", what, dep_errname(rc), dep_errmsg(c), d->desc);
    return rc;
  }
  if (phase != DEP_LL_RECV || !check)
    return 0;
  const int l = xn_ll_rows_differ(d, r, o);
  if (l >= 0)
    return ow_fail(res->msg, "%s: expert %d's rows are not the oracle's [%s]", what, l, d->desc);
  return 0;
}

/*
 * Rank r of the elastic case: sends calls 1 and 2; the victim then stops there, never
 * receiving call 1, until the test kills it.  A survivor receives both (their rows are the
 * other cases' to check: the victim was live in them, and the oracle here masks it), then makes
 * call 3 (the victim masked), whose send must first wait for every peer's read of call 1
 * (its slots are call 3's): it waits while the victim is killed and must end with the
 * victim masked, not at the op timeout.  Then whole low-latency rounds, masked.
 */
static void es_rank_main(struct es_ctl *ctl, const char *sock, uint32_t W, uint32_t r,
                         uint32_t victim, const struct ow_case *cv) {
  struct xn_result *res = &ctl->res[r];
  struct ow_outs o[3];
  for (int i = 0; i < 3; i++)
    ow_outs_alloc(&o[i], cv);
  dep_client_t *c = NULL;
  dep_handle_t *h[3] = {NULL, NULL, NULL};
  int rc = dep_client_new(&c);
  if (rc == 0)
    rc = dep_connect(c, sock);
  struct dep_attach_args a = {.size = sizeof a, .rank = r, .world_size = W, .local_rank = r,
                              .local_world_size = W, .shape = cv->shape,
                              .flags = DEP_ATTACH_ELASTIC};
  snprintf(a.job_id, sizeof a.job_id, "el-splitcall");
  if (rc == 0)
    rc = dep_attach(c, &a);
  for (int i = 0; rc == 0 && i < 3; i++)
    rc = dep_handle_new(c, &h[i]);
  if (rc != 0) {
    ow_fail(res->msg, "attach of rank %u: %s: %s", r, dep_errname(rc), c ? dep_errmsg(c) : "");
    goto out;
  }
  if ((rc = es_ll(c, cv, r, &o[0], h[0], DEP_LL_SEND, false, "send of call 1", res)) != 0 ||
      (rc = es_ll(c, cv, r, &o[1], h[1], DEP_LL_SEND, false, "send of call 2", res)) != 0)
    goto out;
  if (r == victim) {
    atomic_store(&ctl->sent, 1);
    for (;;)
      pause(); /* killed here, with call 1 unread: no taken word for it will ever come */
  }
  if ((rc = es_ll(c, cv, r, &o[0], h[0], DEP_LL_RECV, false, "receive of call 1", res)) != 0 ||
      (rc = es_ll(c, cv, r, &o[1], h[1], DEP_LL_RECV, false, "receive of call 2", res)) != 0)
    goto out;
  atomic_fetch_add(&ctl->read, 1);
  /* Call 3 begins: its send waits for the victim's read of call 1, which the test kills
   * (at once, or before this call began: either way the call ends with it masked). */
  if ((rc = es_ll(c, cv, r, &o[2], h[2], DEP_LL_SEND, false,
                  "send of call 3 (waits for the victim's "
                  "read of call 1, and the victim is killed)", res)) != 0 ||
      (rc = es_ll(c, cv, r, &o[2], h[2], DEP_LL_RECV, true, "receive of call 3", res)) != 0)
    goto out;
  if (!es_await(&ctl->killed, 1)) {
    rc = ow_fail(res->msg, "the test never killed the victim");
    goto out;
  }
  for (uint32_t i = 0; i < 3; i++)
    if ((rc = xn_round(c, cv, r, (int)(i & 1u), &o[0], res)) != 0) {
      snprintf(res->msg + strlen(res->msg), sizeof res->msg - strlen(res->msg),
               " (round %u after the victim was masked)", i);
      goto out;
    }
  if ((rc = dep_detach(c)) != 0)
    ow_fail(res->msg, "dep_detach: %s: %s", dep_errname(rc), dep_errmsg(c));
out:
  res->rc = rc;
  atomic_store(&res->done, 1);
  for (int i = 0; i < 3; i++) {
    dep_handle_free(h[i]);
    ow_outs_free(&o[i]);
  }
  dep_client_free(c);
  _exit(rc == 0 ? 0 : 1);
}

/*
 * An elastic job of 4 ranks on one daemon making split low-latency calls: the victim sends
 * calls 1 and 2 and never receives call 1; the survivors receive both, then their call 3's send waits for the victim's read of call 1 (its slots are
 * call 3's) and the test SIGKILLs the victim.  Every survivor's call 3 ends with the victim
 * masked, its rows the oracle's with the victim masked, and the calls after it too.  The op
 * timeout is XN_OP_TIMEOUT_MS, so that a wait blind to the mask fails quickly
 * (DEP_ERR_TIMEOUT); the survivors are bounded by ES_CEILING_MS, a ceiling for a loaded
 * machine.
 */
START_TEST(a_split_call_waiting_for_a_killed_ranks_read_ends_with_it_masked) {
  ow_seed_init(600 + (uint64_t)_i);
  static const struct ow_scenario sc = {4, 256, 4, 16, 16, 8, P_RANDOM, T_MIXED, DEP_INDEX_I64,
                                        1};
  const uint32_t W = sc.world, victim = (uint32_t)_i % W;
  uint8_t mv[OW_MAXW] = {0};
  mv[victim] = 1;
  struct ow_case *cv = xn_case_new(&sc, 1);
  ow_case_mask(cv, mv); /* the inputs every call sends; the oracle of the calls after */
  char yaml[96];
  snprintf(yaml, sizeof yaml, "limits:\n  op_timeout_ms: %d\n", XN_OP_TIMEOUT_MS);
  struct tu_daemon dm;
  dw_start(&dm, yaml);
  struct es_ctl *ctl = mmap(NULL, sizeof *ctl, PROT_READ | PROT_WRITE,
                            MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  ck_assert_ptr_ne(ctl, MAP_FAILED);
  memset(ctl, 0, sizeof *ctl);
  pid_t pid[OW_MAXW];
  for (uint32_t r = 0; r < W; r++) {
    pid[r] = fork();
    ck_assert_int_ge(pid[r], 0);
    if (pid[r] == 0)
      es_rank_main(ctl, dm.sock, W, r, victim, cv);
  }
  /* The survivors have read calls 1 and 2 and the victim has sent them: each survivor is in
   * (or about to begin) call 3, whose send cannot go on while the victim lives. */
  const bool ready = es_await(&ctl->sent, 1) && es_await(&ctl->read, W - 1);
  kill(pid[victim], SIGKILL);
  waitpid(pid[victim], NULL, 0);
  atomic_store(&ctl->killed, 1);
  char msg[4096] = "";
  for (uint32_t r = 0; r < W; r++) {
    if (r == victim)
      continue;
    if (xn_reap(&pid[r], 1, ES_CEILING_MS))
      continue;
    if (atomic_load(&ctl->res[r].done) && ctl->res[r].rc != 0)
      snprintf(msg + strlen(msg), sizeof msg - strlen(msg), "\n  rank %u: %s", r,
               ctl->res[r].msg);
    else
      snprintf(msg + strlen(msg), sizeof msg - strlen(msg), "\n  rank %u: did not end well "
               "in %d ms", r, ES_CEILING_MS);
  }
  ck_assert_msg(ready && msg[0] == '\0', "victim rank %u%s (DEP_TEST_SEED=%llu):%s", victim,
                ready ? "" : " (the ranks never reached call 3)", (unsigned long long)ow_seed,
                msg);
  munmap(ctl, sizeof *ctl);
  dw_stop_ok(&dm);
  xn_case_free(cv);
}
END_TEST

Suite *ops_split_suite(void);
Suite *ops_split_suite(void) {
  Suite *s = suite_create("ops_split");
  TCase *t = tcase_create("split");
  tcase_set_timeout(t, 60);
  tcase_add_loop_test(t, split_calls_equal_whole_calls_bit_for_bit, 0, N_SPLIT_SCENARIOS);
  tcase_add_loop_test(t, two_micro_batches_interleave_on_every_rank, 0, N_SPLIT_SCENARIOS);
  tcase_add_test(t, a_call_waits_for_a_peer_two_receives_behind);
  tcase_add_test(t, a_peer_that_never_receives_times_the_next_call_out_unoverwritten);
  tcase_add_test(t, invalid_sequences_are_refused_naming_phases_and_the_job_goes_on);
  tcase_add_test(t, wait_costs_are_added_by_receives_only);
  suite_add_tcase(s, t);
  TCase *x = tcase_create("across_nodes");
  tcase_set_timeout(x, 180);
  tcase_add_test(x, across_nodes_a_slow_receiver_is_not_overwritten);
  suite_add_tcase(s, x);
  TCase *e = tcase_create("elastic");
  tcase_set_timeout(e, 120);
  tcase_add_loop_test(e, a_split_call_waiting_for_a_killed_ranks_read_ends_with_it_masked, 0, 2);
  suite_add_tcase(s, e);
  return s;
}
