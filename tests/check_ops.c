/*
 * check_ops.c — the host backend's MoE operations as a specification
 * (DESIGN §6): ranks are real processes sharing memfd slabs, every output
 * is checked against the reference oracle (tests/ref.c) — moves bit for
 * bit, sums within a stated bound — over world sizes, shapes, routing
 * patterns and both index types; outputs are poisoned before every call so
 * an unwritten element fails; 1,000 calls in a row stay correct; a missing
 * rank is a bounded DEP_ERR_TIMEOUT that names it, and a rank the daemon
 * found gone a DEP_ERR_PEER within milliseconds.  Bad arguments, handles
 * and contexts are check_ops_args.c's; the throughput extensions (FP8,
 * cached mode, worst-case rows, alignment, weights, int64 ids) are
 * check_ops_ext.c's.
 *
 * Inputs are fresh random data each run; a failure prints the seed, and
 * DEP_TEST_SEED=<seed> replays it.
 */
#include <check.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "host_ops.h"
#include "opsworld.h"
#include "ref.h"

static int round_layout(struct ops_ctx *c, const struct ow_case *d, struct ow_outs *o, uint8_t pz,
                        char *msg) {
  const uint32_t r = c->rank, W = d->sc.world, E = d->sc.experts, n = d->in[r].num_tokens;
  int32_t tpr[OW_MAXW], *tpe = malloc(E * 4);
  uint8_t *tir = malloc((size_t)n * W + 1);
  ref_layout(&d->shape, W, &d->in[r], tpr, tpe, tir);
  memset(o->tpr, pz, W * 4);
  memset(o->tpe, pz, E * 4);
  memset(o->tir, pz, (size_t)d->sc.max_tokens * W);
  struct dep_layout_args a = {sizeof(struct dep_layout_args), d->idx[r], d->sc.itype, n, o->tpr,
                              o->tpe, o->tir};
  int rc = host_ops_layout(c, &a);
  int bad = rc != 0 || memcmp(o->tpr, tpr, W * 4) != 0 || memcmp(o->tpe, tpe, E * 4) != 0 ||
            memcmp(o->tir, tir, (size_t)n * W) != 0 ||
            ow_unpoisoned(o->tir + (size_t)n * W, (size_t)(d->sc.max_tokens - n) * W, pz) >= 0;
  free(tpe);
  free(tir);
  return bad ? ow_fail(msg, "layout: rc %d, outputs differ from the oracle [%s]", rc, d->desc) : 0;
}

/* Layout, dispatch, combine, LL dispatch, LL combine; twice, bit-identical. */
static int scenario_rank(struct ops_ctx *c, void *arg, char *msg) {
  const struct ow_case *d = arg;
  struct ow_outs o;
  ow_outs_alloc(&o, d);
  uint64_t dig[2] = {0, 0};
  int rc = 0;
  for (int round = 0; round < 2 && rc == 0; round++) {
    uint8_t pz = round ? 0x5A : 0xA5;
    rc = round_layout(c, d, &o, pz, msg) || ow_round_tp(c, d, &o, pz, &dig[round], msg) ||
         ow_round_ll(c, d, &o, pz, &dig[round], msg);
  }
  if (rc == 0 && dig[0] != dig[1])
    rc = ow_fail(msg, "two identical rounds gave different outputs [%s]", d->desc);
  ow_outs_free(&o);
  return rc;
}

static const struct ow_scenario scenarios[] = {
  /* world hidden topk experts max_tokens max_ll  routing  tokens  index  fp8 */
  {1, 128, 1, 4, 8, 8, P_RANDOM, T_MAX, DEP_INDEX_I64, 0},
  {1, 2048, 16, 32, 16, 8, P_DUP, T_MAX, DEP_INDEX_I32, 1},
  {2, 2048, 2, 8, 16, 16, P_RANDOM, T_MIXED, DEP_INDEX_I32, 1},
  {2, 128, 8, 8, 16, 16, P_RANDOM, T_ZERO, DEP_INDEX_I64, 0},
  {3, 128, 8, 12, 32, 16, P_RANDOM, T_MAX, DEP_INDEX_I64, 0},
  {3, 2048, 16, 18, 8, 8, P_DUP, T_MIXED, DEP_INDEX_I32, 1},  /* top-16 over 6 local experts */
  {4, 128, 16, 16, 32, 32, P_RANDOM, T_MAX, DEP_INDEX_I32, 1},
  {4, 7168, 2, 8, 16, 8, P_RANDOM, T_ONE, DEP_INDEX_I64, 0},
  {4, 2048, 8, 32, 16, 16, P_ONE_RANK, T_MAX, DEP_INDEX_I64, 1},
  {4, 128, 8, 16, 16, 16, P_NONE, T_MAX, DEP_INDEX_I32, 0},
  {4, 128, 1, 4, 64, 64, P_ONE_EXPERT, T_MAX, DEP_INDEX_I64, 0},
  {8, 128, 8, 64, 16, 16, P_RANDOM, T_MIXED, DEP_INDEX_I64, 1},
  {8, 7168, 8, 16, 8, 8, P_RANDOM, T_MAX, DEP_INDEX_I32, 1},
  {8, 128, 16, 32, 16, 16, P_ONE_EXPERT, T_MAX, DEP_INDEX_I32, 1},
  {8, 2048, 16, 128, 32, 32, P_RANDOM, T_MAX, DEP_INDEX_I64, 0},
  {8, 128, 2, 8, 16, 16, P_RANDOM, T_ZERO, DEP_INDEX_I32, 1},
  {8, 128, 16, 16, 16, 4, P_DUP, T_ONE, DEP_INDEX_I64, 0},   /* top-16 over 2 local experts */
  {8, 2048, 8, 16, 16, 16, P_ONE_RANK, T_MIXED, DEP_INDEX_I32, 0},
  {2, 128, 4, 4, 24, 0, P_RANDOM, T_MAX, DEP_INDEX_I32, 1}, /* max_ll 0: the default bound */
};

/* Every operation on every rank matches the oracle, for each scenario. */
START_TEST(every_op_matches_the_oracle) {
  ow_seed_init((uint64_t)_i);
  const struct ow_scenario *sc = &scenarios[_i];
  struct ow_case *d = malloc(sizeof *d);
  ow_case_make(d, sc, sc->fp8);
  ow_run_ranks(&d->shape, sc->world, scenario_rank, d, d->desc);
  ow_case_free(d);
  free(d);
}
END_TEST

/* ---- 1,000 calls in a row ------------------------------------------------------- */

#define NSETS 5
struct sets {
  struct ow_case d[NSETS];
};

/* 250 rounds of dispatch, combine, LL dispatch, LL combine: 1,000 calls,
 * inputs changing every round, FP8 on in alternate sets. */
static int back_to_back_rank(struct ops_ctx *c, void *arg, char *msg) {
  struct sets *s = arg;
  struct ow_outs o;
  ow_outs_alloc(&o, &s->d[0]);
  int rc = 0, calls = 0;
  for (int round = 0; round < 250 && rc == 0; round++) {
    const struct ow_case *d = &s->d[round % NSETS];
    uint64_t dig = 0;
    uint8_t pz = round & 1 ? 0x5A : 0xA5;
    rc = ow_round_tp(c, d, &o, pz, &dig, msg) || ow_round_ll(c, d, &o, pz, &dig, msg);
    if (rc)
      snprintf(msg + strlen(msg), OW_MSG - strlen(msg), " (round %d)", round);
    calls += rc ? 0 : 4;
  }
  if (rc == 0 && (calls != 1000 || c->seq != 1000))
    rc = ow_fail(msg, "made %d calls, seq %llu", calls, (unsigned long long)c->seq);
  ow_outs_free(&o);
  return rc;
}

START_TEST(thousand_calls_back_to_back_stay_correct) {
  ow_seed_init(0);
  struct ow_scenario sc = {4, 128, 2, 8, 8, 8, P_RANDOM, T_MIXED, DEP_INDEX_I32, 0};
  struct sets *s = malloc(sizeof *s);
  for (int i = 0; i < NSETS; i++) {
    sc.itype = i & 1 ? DEP_INDEX_I64 : DEP_INDEX_I32;
    ow_case_make(&s->d[i], &sc, i & 1);
  }
  ow_run_ranks(&s->d[0].shape, sc.world, back_to_back_rank, s, "1000 calls");
  for (int i = 0; i < NSETS; i++)
    ow_case_free(&s->d[i]);
  free(s);
}
END_TEST

/* ---- faults: a missing rank, ranks out of step ---------------------------------- */


struct timeout_arg {
  struct ow_case d;
  uint32_t missing;
  int phase; /* 0: the missing rank never calls; 1: it stops after dispatch; 2: after ll_dispatch */
};

static uint64_t ms_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

static int timeout_rank(struct ops_ctx *c, void *arg, char *msg) {
  struct timeout_arg *t = arg;
  const struct ow_case *d = &t->d;
  struct ow_outs o;
  ow_outs_alloc(&o, d);
  int rc = 0;
  if (t->phase == 1)
    rc = ow_dispatch(c, d, &o, &o.h);
  else if (t->phase == 2)
    rc = ow_ll_dispatch(c, d, &o, 0);
  if (rc != 0 || c->rank == t->missing) {
    ow_outs_free(&o);
    return rc ? ow_fail(msg, "first call: %s: %s", dep_errname(rc), c->why) : 0;
  }
  c->timeout_ms = 200;
  uint32_t op = t->phase == 0 ? OPS_OP_DISPATCH : t->phase == 1 ? OPS_OP_COMBINE
                                                                 : OPS_OP_LL_COMBINE;
  uint64_t t0 = ms_now();
  if (t->phase == 0) {
    rc = ow_dispatch(c, d, &o, &o.h);
  } else if (t->phase == 1) {
    struct dep_combine_args ca = {.size = sizeof(struct dep_combine_args), .x = d->cx[c->rank],
                                  .out = o.out};
    rc = host_ops_combine(c, &ca, &o.h);
  } else {
    struct dep_ll_combine_args lc = {sizeof(struct dep_ll_combine_args), d->lx[c->rank],
                                     d->idx[c->rank], d->sc.itype,
                                     d->in_ll[c->rank].topk_weights, o.lout, 0, NULL};
    rc = host_ops_ll_combine(c, &lc, &o.h);
  }
  uint64_t waited = ms_now() - t0;
  struct ops_err_record er;
  host_ops_err_read(c->slabs[c->rank], &er);
  char name[32];
  snprintf(name, sizeof name, "rank %u", t->missing);
  uint64_t seq = t->phase == 0 ? 1 : 2;
  if (rc != DEP_ERR_TIMEOUT)
    rc = ow_fail(msg, "%s returned %s, want DEP_ERR_TIMEOUT", host_ops_op_name(op),
                 dep_errname(rc));
  else if (waited < 190 || waited > 5000)
    rc = ow_fail(msg, "timed out after %llu ms with a 200 ms bound", (unsigned long long)waited);
  else if (strstr(c->why, name) == NULL)
    rc = ow_fail(msg, "message does not name the missing %s: %s", name, c->why);
  else if (atomic_load(&er.code) != DEP_ERR_TIMEOUT || er.op != op || er.rank != c->rank ||
           er.source != t->missing || er.seq != seq || er.waited_ms < 190)
    rc = ow_fail(msg, "error record {code %d op %u rank %u source %u seq %llu waited %u}, want "
               "{%d %u %u %u %llu >=200}", atomic_load(&er.code), er.op, er.rank, er.source,
               (unsigned long long)er.seq, er.waited_ms, DEP_ERR_TIMEOUT, op, c->rank, t->missing,
               (unsigned long long)seq);
  else if ((rc = ow_dispatch(c, d, &o, &o.h)) != DEP_ERR_STATE)
    rc = ow_fail(msg, "the call after a timeout returned %s, want DEP_ERR_STATE", dep_errname(rc));
  else
    rc = 0;
  ow_outs_free(&o);
  return rc;
}

/* A rank that does not come is a DEP_ERR_TIMEOUT within the bound, named in the error record. */
START_TEST(missing_rank_times_out_and_is_named) {
  ow_seed_init(0);
  struct timeout_arg *t = malloc(sizeof *t);
  struct ow_scenario sc = ow_small;
  sc.world = _i == 0 ? 2 : 3;
  sc.experts = 6;
  t->phase = _i;
  t->missing = _i == 2 ? 2 : 1;
  ow_case_make(&t->d, &sc, 0);
  ow_run_ranks(&t->d.shape, sc.world, timeout_rank, t, "missing rank");
  ow_case_free(&t->d);
  free(t);
}
END_TEST

/* ---- a peer the daemon found gone ----------------------------------------------------- */

/* The daemon's part (slab.h): the abort words in a surviving rank's slab,
 * rank and pid first, code last with release ordering. */
struct abort_writer {
  uint8_t *slab;
  uint32_t rank, pid, detached, delay_ms;
};

static void write_abort(const struct abort_writer *a) {
  struct dep_slab_abort *ab = (struct dep_slab_abort *)(a->slab + DEP_SLAB_ABORT_OFF);
  ab->rank = a->rank;
  ab->pid = a->pid;
  ab->detached = a->detached;
  __atomic_store_n(&ab->code, DEP_ERR_PEER, __ATOMIC_RELEASE);
}

static void *abort_later(void *arg) {
  const struct abort_writer *a = arg;
  struct timespec ts = {0, (long)a->delay_ms * 1000000L};
  nanosleep(&ts, NULL);
  write_abort(a);
  return NULL;
}

/* Rank 0's op timeout in these tests, the default 10 s: a gone peer fails
 * its wait long before. */
#define GONE_TIMEOUT_MS 10000

/* Post source src's slot for call seq into rank 0's slab: a dispatch of no rows to it. */
static void post_empty_dispatch(struct ow_rank0 *g, uint32_t src, uint64_t seq) {
  struct ops_slot *sl =
      (struct ops_slot *)(g->w.slabs[0] + dep_slab_ctrl_slot(&g->w.lay, (unsigned)(seq & 1), src));
  sl->rows = 0;
  sl->op = OPS_OP_DISPATCH;
  sl->ref_seq = 0;
  sl->num_tokens = 0;
  atomic_store_explicit(&sl->flag, seq, memory_order_release);
}

struct late_post {
  struct ow_rank0 *g;
  uint32_t src;
  uint32_t delay_ms;
};

static void *post_later(void *arg) {
  const struct late_post *p = arg;
  struct timespec ts = {0, (long)p->delay_ms * 1000000L};
  nanosleep(&ts, NULL);
  post_empty_dispatch(p->g, p->src, 1);
  return NULL;
}

/* The call failed with DEP_ERR_PEER naming rank 1 and pid 4242, recorded,
 * soon after the abort words came (not after the 10 s timeout). */
static void expect_gone(struct ow_rank0 *g, int rc, uint64_t waited_ms, uint32_t op,
                        uint64_t seq, uint32_t detached) {
  ck_assert_msg(rc == DEP_ERR_PEER, "%s returned %s: %s", host_ops_op_name(op), dep_errname(rc),
                g->c.why);
  ck_assert_msg(waited_ms < 1000, "DEP_ERR_PEER after %llu ms", (unsigned long long)waited_ms);
  const char *want = detached ? "rank 1 (pid 4242) of the job is gone (it detached) while this "
                                "rank waited for it in "
                              : "rank 1 (pid 4242) of the job is gone (its process ended) while "
                                "this rank waited for it in ";
  ck_assert_msg(strncmp(g->c.why, want, strlen(want)) == 0, "said: %s", g->c.why);
  ck_assert_ptr_nonnull(strstr(g->c.why, host_ops_op_name(op)));
  ck_assert_ptr_nonnull(strstr(g->c.why, "restart"));
  struct ops_err_record er;
  host_ops_err_read(g->w.slabs[0], &er);
  ck_assert_int_eq(atomic_load(&er.code), DEP_ERR_PEER);
  ck_assert_uint_eq(er.op, op);
  ck_assert_uint_eq(er.rank, 0);
  ck_assert_uint_eq(er.source, 1);
  ck_assert_uint_eq(er.seq, seq);
  ck_assert_uint_eq(er.seen_flag, OPS_ERR_GONE(4242, detached));
  /* The job cannot go on: the context is broken, as after a timeout. */
  ck_assert_int_eq(ow_dispatch(&g->c, &g->d, &g->o, &g->o.h), DEP_ERR_STATE);
  ck_assert_ptr_nonnull(strstr(g->c.why, "gone"));
}

/* Rank 1 never comes; 50 ms into rank 0's wait the daemon writes the abort
 * words (rank 1 died, or detached): the dispatch fails at once with
 * DEP_ERR_PEER naming it, not after the 10 s timeout. */
START_TEST(a_gone_peer_fails_the_wait_at_once_naming_it) {
  struct ow_rank0 *g = ow_rank0_open(&ow_small, GONE_TIMEOUT_MS);
  struct abort_writer a = {g->w.slabs[0], 1, 4242, (uint32_t)_i, 50};
  pthread_t th;
  ck_assert_int_eq(pthread_create(&th, NULL, abort_later, &a), 0);
  uint64_t t0 = ms_now();
  int rc = ow_dispatch(&g->c, &g->d, &g->o, &g->o.h);
  uint64_t waited = ms_now() - t0;
  pthread_join(th, NULL);
  printf("ops: a gone peer: %s after %llu ms: %s\n", dep_errname(rc), (unsigned long long)waited,
         g->c.why);
  ck_assert_msg(waited >= 40, "failed after %llu ms, before the abort words were written",
                (unsigned long long)waited);
  expect_gone(g, rc, waited, OPS_OP_DISPATCH, 1, (uint32_t)_i);
  ow_rank0_close(g);
}
END_TEST

/* Rank 1 pushed everything for call 1 and then left: the flag is checked
 * before the abort words, so call 1 completes; call 2, which rank 1 will
 * never make, fails at once. */
START_TEST(a_peer_that_posted_before_leaving_is_no_error_until_it_is_waited_for) {
  struct ow_rank0 *g = ow_rank0_open(&ow_small, GONE_TIMEOUT_MS);
  struct ops_slot *sl = (struct ops_slot *)(g->w.slabs[0] + dep_slab_ctrl_slot(&g->w.lay, 1, 1));
  sl->rows = 0; /* rank 1's call 1: a dispatch of no rows to rank 0 */
  sl->op = OPS_OP_DISPATCH;
  sl->ref_seq = 0;
  sl->num_tokens = 0;
  atomic_store_explicit(&sl->flag, 1, memory_order_release);
  struct abort_writer a = {g->w.slabs[0], 1, 4242, 0, 0};
  write_abort(&a);
  int rc = ow_dispatch(&g->c, &g->d, &g->o, &g->o.h);
  ck_assert_msg(rc == 0, "dispatch with every flag there: %s: %s", dep_errname(rc), g->c.why);
  ck_assert_uint_eq(g->o.h.recv_from[1], 0);
  struct ops_err_record er;
  host_ops_err_read(g->w.slabs[0], &er);
  ck_assert_int_eq(atomic_load(&er.code), 0);
  struct dep_combine_args ca = {.size = sizeof(struct dep_combine_args), .x = g->d.cx[0],
                                .out = g->o.out};
  uint64_t t0 = ms_now();
  rc = host_ops_combine(&g->c, &ca, &g->o.h);
  expect_gone(g, rc, ms_now() - t0, OPS_OP_COMBINE, 2, 0);
  ow_rank0_close(g);
}
END_TEST

/* A world of 3: rank 2 posted call 1 and then left (it detached: the clean
 * end of a job whose other ranks are still finishing); rank 1 is alive but
 * slower.  Rank 0's wait for rank 1 does not fail on rank 2's departure:
 * call 1 completes when rank 1 posts; call 2, which rank 2 will never make,
 * fails at once naming it. */
START_TEST(a_peer_that_left_after_posting_fails_no_wait_for_a_slower_live_one) {
  static const struct ow_scenario three = {3, 128, 2, 6, 4, 4, P_RANDOM, T_MAX, DEP_INDEX_I64, 0};
  struct ow_rank0 *g = ow_rank0_open(&three, GONE_TIMEOUT_MS);
  post_empty_dispatch(g, 2, 1);
  struct abort_writer a = {g->w.slabs[0], 2, 4343, 1, 0};
  write_abort(&a);
  struct late_post lp = {g, 1, 100};
  pthread_t th;
  ck_assert_int_eq(pthread_create(&th, NULL, post_later, &lp), 0);
  uint64_t t0 = ms_now();
  int rc = ow_dispatch(&g->c, &g->d, &g->o, &g->o.h);
  uint64_t waited = ms_now() - t0;
  pthread_join(th, NULL);
  ck_assert_msg(rc == 0, "dispatch waiting for live rank 1 gave %s after %llu ms: %s",
                dep_errname(rc), (unsigned long long)waited, g->c.why);
  ck_assert_uint_ge(waited, 90);
  struct dep_combine_args ca = {.size = sizeof(struct dep_combine_args), .x = g->d.cx[0],
                                .out = g->o.out};
  rc = host_ops_combine(&g->c, &ca, &g->o.h);
  ck_assert_msg(rc == DEP_ERR_PEER, "combine gave %s: %s", dep_errname(rc), g->c.why);
  ck_assert_msg(strstr(g->c.why, "rank 2 (pid 4343) of the job is gone (it detached)") != NULL,
                "said: %s", g->c.why);
  ow_rank0_close(g);
}
END_TEST

static int out_of_step_rank(struct ops_ctx *c, void *arg, char *msg) {
  const struct ow_case *d = arg;
  struct ow_outs o;
  ow_outs_alloc(&o, d);
  struct dep_handle h2;
  host_ops_handle_init(&h2);
  int rc = 0;
  /* Different operations in one call. */
  if (c->rank == 0)
    rc = ow_dispatch(c, d, &o, &o.h);
  else
    rc = ow_ll_dispatch(c, d, &o, 0);
  if (rc != DEP_ERR_MISMATCH || strstr(c->why, "rank") == NULL)
    rc = ow_fail(msg, "dispatch against ll_dispatch: %s (%s)", dep_errname(rc), c->why);
  /* FP8 on one rank only. */
  else if ((rc = ow_ll_dispatch(c, d, &o, (int)c->rank)) != DEP_ERR_MISMATCH)
    rc = ow_fail(msg, "ll_dispatch with and without fp8: %s (%s)", dep_errname(rc), c->why);
  /* Combines of different dispatches. */
  else if ((rc = ow_dispatch(c, d, &o, &o.h)) != 0 || (rc = ow_dispatch(c, d, &o, &h2)) != 0)
    rc = ow_fail(msg, "dispatch after mismatches: %s (%s)", dep_errname(rc), c->why);
  else {
    struct dep_combine_args ca = {.size = sizeof(struct dep_combine_args), .x = d->cx[c->rank],
                                  .out = o.out};
    rc = host_ops_combine(c, &ca, c->rank == 0 ? &o.h : &h2);
    if (rc != DEP_ERR_MISMATCH || strstr(c->why, "dispatch of call") == NULL)
      rc = ow_fail(msg, "combine of different dispatches: %s (%s)", dep_errname(rc), c->why);
    else
      rc = 0;
  }
  /* Still in step: a full round is right. */
  uint64_t dig = 0;
  if (rc == 0)
    rc = ow_round_tp(c, d, &o, 0xA5, &dig, msg) || ow_round_ll(c, d, &o, 0xA5, &dig, msg);
  if (rc == 0 && c->seq != 9)
    rc = ow_fail(msg, "seq %llu after 9 calls", (unsigned long long)c->seq);
  host_ops_handle_fini(&h2);
  ow_outs_free(&o);
  return rc;
}

/* Ranks that make different calls get DEP_ERR_MISMATCH, then carry on in step. */
START_TEST(ranks_making_different_calls_get_mismatch_and_stay_in_step) {
  ow_run_small(out_of_step_rank, "out of step");
}
END_TEST

/* ---- streaming: the throughput ops through channels of a few rows ---------------------- */

/* The chunks the streaming cases run with: one row, and three (slab.h: 4 chunks a channel). */
static const uint32_t stream_chunks[] = {1, 3};
#define N_STREAM_CHUNKS (sizeof stream_chunks / sizeof stream_chunks[0])

/* Every scenario, every op, against the oracle, with the throughput ops
 * streaming through channels of 4 and 12 rows (LL calls between them
 * share the slab's blocks). */
START_TEST(every_op_matches_the_oracle_streaming_in_small_chunks) {
  const uint32_t n = (uint32_t)(sizeof scenarios / sizeof scenarios[0]);
  ow_seed_init((uint64_t)_i + 1000);
  const struct ow_scenario sc = scenarios[(uint32_t)_i % n];
  const uint32_t chunk = stream_chunks[(uint32_t)_i / n];
  struct ow_case *d = malloc(sizeof *d);
  ow_case_make(d, &sc, sc.fp8);
  ow_run_ranks_chunked(&d->shape, sc.world, chunk, scenario_rank, d, d->desc);
  ow_case_free(d);
  free(d);
}
END_TEST

/* Rank 1 comes late to every call: its senders fill its channels (4 rows
 * each) and wait for its credit; nothing is overwritten, every output is
 * the oracle's. */
static int late_rank(struct ops_ctx *c, void *arg, char *msg) {
  if (c->rank == 1) {
    struct timespec ts = {0, 30 * 1000000L};
    nanosleep(&ts, NULL);
  }
  return scenario_rank(c, arg, msg);
}

START_TEST(a_slow_receiver_holds_its_senders_back_and_loses_nothing) {
  static const struct ow_scenario sc = {4, 128, 4, 8, 64, 16, P_RANDOM, T_MAX, DEP_INDEX_I32, 1};
  ow_seed_init(77);
  struct ow_case *d = malloc(sizeof *d);
  ow_case_make(d, &sc, sc.fp8);
  ow_run_ranks_chunked(&d->shape, sc.world, 1, late_rank, d, d->desc);
  ow_case_free(d);
  free(d);
}
END_TEST

/* Rank 1 posted call 1's slot (10 rows for rank 0) and 2 rows, then died:
 * rank 0 waits for its rows and for its credit (rank 0 has more rows for
 * it than its 4-row channel holds); the abort words fail the dispatch at
 * once with DEP_ERR_PEER naming it, not after the 10 s timeout. */
START_TEST(a_rank_gone_mid_stream_fails_its_peers_at_once) {
  /* Every token to rank 1: 16 rows for its 4-row channel. */
  static const struct ow_scenario sc = {2, 128, 2, 4, 16, 4, P_ONE_RANK, T_MAX, DEP_INDEX_I64, 0};
  struct ow_rank0 *g = ow_rank0_open_chunked(&sc, 1, GONE_TIMEOUT_MS);
  struct ops_slot *sl = (struct ops_slot *)(g->w.slabs[0] + dep_slab_ctrl_slot(&g->w.lay, 1, 1));
  sl->rows = 10;
  sl->op = OPS_OP_DISPATCH;
  atomic_store_explicit(&sl->flag, 1, memory_order_release);
  atomic_store_explicit(&sl->tail, DEP_SLAB_CHAN_AT(1, 2), memory_order_release);
  struct abort_writer a = {g->w.slabs[0], 1, 4242, 0, 50};
  pthread_t th;
  ck_assert_int_eq(pthread_create(&th, NULL, abort_later, &a), 0);
  uint64_t t0 = ms_now();
  int rc = ow_dispatch(&g->c, &g->d, &g->o, &g->o.h);
  uint64_t waited = ms_now() - t0;
  pthread_join(th, NULL);
  ck_assert_msg(waited >= 40, "failed after %llu ms, before the abort words were written: %s",
                (unsigned long long)waited, g->c.why);
  expect_gone(g, rc, waited, OPS_OP_DISPATCH, 1, 0);
  ow_rank0_close(g);
}
END_TEST

/* A live rank this call waits for (here, for its credit) stopped its own
 * call with a failure (its error record says so): this rank stops too,
 * with DEP_ERR_PEER naming it, rather than waiting out the timeout. */
START_TEST(a_peer_that_failed_its_call_stops_the_ranks_waiting_for_its_credit) {
  /* Every token to rank 1: 32 rows for its 4-row channel. */
  static const struct ow_scenario sc = {2, 128, 1, 2, 32, 4, P_ONE_RANK, T_MAX, DEP_INDEX_I64, 0};
  struct ow_rank0 *g = ow_rank0_open_chunked(&sc, 1, GONE_TIMEOUT_MS);
  /* Rank 1 posted call 1 (no rows for rank 0), then failed in it waiting for rank 0. */
  post_empty_dispatch(g, 1, 1);
  struct ops_err_record *er = (struct ops_err_record *)g->w.slabs[1];
  er->op = OPS_OP_DISPATCH;
  er->rank = 1;
  er->source = 0;
  er->seq = 1;
  atomic_store_explicit(&er->code, DEP_ERR_TIMEOUT, memory_order_release);
  uint64_t t0 = ms_now();
  int rc = ow_dispatch(&g->c, &g->d, &g->o, &g->o.h);
  uint64_t waited = ms_now() - t0;
  ck_assert_msg(rc == DEP_ERR_PEER && strstr(g->c.why, "rank 1 stopped in call 1") != NULL,
                "dispatch gave %s after %llu ms: %s", dep_errname(rc), (unsigned long long)waited,
                g->c.why);
  ck_assert_msg(waited < GONE_TIMEOUT_MS / 2, "after %llu ms", (unsigned long long)waited);
  ow_rank0_close(g);
}
END_TEST

/* ---- number formats ------------------------------------------------------------ */

/* The converter agrees with the brute-force nearest code everywhere tested. */
START_TEST(e4m3_matches_brute_force_on_every_bf16_and_random_floats) {
  ow_seed_init(0);
  for (uint32_t b = 0; b < 65536; b++) {
    float f = host_ops_bf16_to_float((uint16_t)b);
    ck_assert_msg(host_ops_float_to_e4m3(f) == ref_e4m3(f), "bf16 0x%04x (%g): 0x%02x, want 0x%02x",
                  b, f, host_ops_float_to_e4m3(f), ref_e4m3(f));
  }
  for (int i = 0; i < 200000; i++) {
    float f;
    if (i & 1) {
      uint32_t u = (uint32_t)ow_rnd();
      memcpy(&f, &u, 4);
    } else {
      f = ldexpf(ow_unif() * 2.0f - 1.0f, (int)ow_below(30) - 20);
    }
    ck_assert_msg(host_ops_float_to_e4m3(f) == ref_e4m3(f), "%a: 0x%02x, want 0x%02x (seed %llu)",
                  f, host_ops_float_to_e4m3(f), ref_e4m3(f), (unsigned long long)ow_seed);
  }
  for (int code = 0; code < 256; code++) {
    if ((code & 0x7f) == 0x7f)
      continue;
    ck_assert(host_ops_e4m3_to_float((uint8_t)code) == ref_e4m3_value((uint8_t)code));
    ck_assert_int_eq(host_ops_float_to_e4m3(host_ops_e4m3_to_float((uint8_t)code)), code);
  }
}
END_TEST

START_TEST(e4m3_edges_round_to_nearest_even_and_saturate) {
  static const struct {
    float v;
    uint8_t code;
  } cases[] = {
    {0.0f, 0x00}, {-0.0f, 0x80}, {1.0f, 0x38}, {-1.0f, 0xb8},
    {1.0625f, 0x38},            /* tie between 1 and 1.125: even */
    {1.1875f, 0x3a},            /* tie between 1.125 and 1.25: even */
    {448.0f, 0x7e}, {464.0f, 0x7e}, {1e9f, 0x7e}, {-1e9f, 0xfe},
    {INFINITY, 0x7e}, {-INFINITY, 0xfe},
    {0x1p-9f, 0x01},            /* smallest subnormal */
    {0x1p-10f, 0x00},           /* half of it: tie to even zero */
    {0x3p-10f, 0x02},           /* 1.5 subnormal steps: tie to even 2 */
    {0x1p-6f, 0x08},            /* smallest normal */
    {0x1.fp-7f, 0x08},          /* rounds up across the subnormal boundary */
    {240.0f, 0x77}, {0x1p-20f, 0x00}, {0x1p-130f, 0x00},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
    ck_assert_msg(host_ops_float_to_e4m3(cases[i].v) == cases[i].code, "%a -> 0x%02x, want 0x%02x",
                  cases[i].v, host_ops_float_to_e4m3(cases[i].v), cases[i].code);
  ck_assert_int_eq(host_ops_float_to_e4m3(NAN) & 0x7f, 0x7f);
}
END_TEST

START_TEST(bf16_rounds_to_nearest_even) {
  ck_assert_uint_eq(host_ops_float_to_bf16(1.0f), 0x3f80);
  ck_assert_uint_eq(host_ops_float_to_bf16(1.0f + 0x1p-8f), 0x3f80);          /* tie: even */
  ck_assert_uint_eq(host_ops_float_to_bf16(1.0f + 0x3p-8f), 0x3f82);          /* tie: even */
  ck_assert_uint_eq(host_ops_float_to_bf16(1.0f + 0x1p-8f + 0x1p-20f), 0x3f81);
  ck_assert_uint_eq(host_ops_float_to_bf16(-2.0f), 0xc000);
  ck_assert_uint_eq(host_ops_float_to_bf16(INFINITY), 0x7f80);
  ck_assert(isnan(host_ops_bf16_to_float(host_ops_float_to_bf16(NAN))));
  for (uint32_t b = 0; b < 65536; b++) {
    float f = host_ops_bf16_to_float((uint16_t)b);
    if (!isnan(f))
      ck_assert_uint_eq(host_ops_float_to_bf16(f), b);
  }
}
END_TEST

Suite *ops_suite(void);
Suite *ops_suite(void) {
  Suite *s = suite_create("ops");
  TCase *conv = tcase_create("formats");
  tcase_add_test(conv, e4m3_matches_brute_force_on_every_bf16_and_random_floats);
  tcase_add_test(conv, e4m3_edges_round_to_nearest_even_and_saturate);
  tcase_add_test(conv, bf16_rounds_to_nearest_even);
  suite_add_tcase(s, conv);

  TCase *ops = tcase_create("oracle");
  tcase_set_timeout(ops, 60);
  tcase_add_loop_test(ops, every_op_matches_the_oracle, 0,
                      (int)(sizeof scenarios / sizeof scenarios[0]));
  tcase_add_test(ops, thousand_calls_back_to_back_stay_correct);
  suite_add_tcase(s, ops);

  TCase *stream = tcase_create("stream");
  tcase_set_timeout(stream, 60);
  tcase_add_loop_test(stream, every_op_matches_the_oracle_streaming_in_small_chunks, 0,
                      (int)(N_STREAM_CHUNKS * (sizeof scenarios / sizeof scenarios[0])));
  tcase_add_test(stream, a_slow_receiver_holds_its_senders_back_and_loses_nothing);
  tcase_add_test(stream, a_rank_gone_mid_stream_fails_its_peers_at_once);
  tcase_add_test(stream, a_peer_that_failed_its_call_stops_the_ranks_waiting_for_its_credit);
  suite_add_tcase(s, stream);

  TCase *faults = tcase_create("faults");
  tcase_set_timeout(faults, 30);
  tcase_add_loop_test(faults, missing_rank_times_out_and_is_named, 0, 3);
  tcase_add_loop_test(faults, a_gone_peer_fails_the_wait_at_once_naming_it, 0, 2);
  tcase_add_test(faults, a_peer_that_posted_before_leaving_is_no_error_until_it_is_waited_for);
  tcase_add_test(faults, a_peer_that_left_after_posting_fails_no_wait_for_a_slower_live_one);
  tcase_add_test(faults, ranks_making_different_calls_get_mismatch_and_stay_in_step);
  suite_add_tcase(s, faults);
  return s;
}
