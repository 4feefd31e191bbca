/*
 * check_ops_mask.c — masked ranks (deepep.h "Masked ranks", DESIGN §14) on
 * the host backend as a specification: ranks are real processes sharing
 * memfd slabs; a rank masked by its bit in the live mask (written into the
 * slabs as the daemon writes it: the bits, then the epoch with release
 * ordering) or by every rank's own mask gets nothing and stops no one, and
 * every other rank's outputs match the oracle with that rank masked
 * (ref_mask), throughput and low-latency, bf16 and FP8 (and the pairs each
 * dispatch dropped); a masked rank that
 * is dead, in a job whose abort words are never written, stops no one; a
 * wait already waiting for a rank when its bit is written completes; and
 * the C API's mask calls through a real daemon.
 *
 * Inputs are fresh random data each run; a failure prints the seed, and
 * DEP_TEST_SEED=<seed> replays it.
 */
#include <check.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "clienttest.h"
#include "host_ops.h"
#include "opsworld.h"
#include "ref.h"
#include "testutil.h"

/* Write the live mask into a rank's slab as the daemon does: bits, then the epoch (release). */
static void write_live_mask(uint8_t *slab, const struct dep_slab_layout *lay, const uint8_t *masked,
                            uint32_t world, uint64_t epoch) {
  for (uint32_t r = 0; r < world; r++)
    if (masked[r])
      __atomic_fetch_or((uint64_t *)(slab + dep_slab_mask_word(lay, r)), DEP_SLAB_MASK_BIT(r),
                        __ATOMIC_RELAXED);
  __atomic_store_n((uint64_t *)(slab + dep_slab_mask_epoch(lay)), epoch, __ATOMIC_RELEASE);
}

/* How a test masks its ranks. */
enum how { BY_LIVE_BIT, BY_OWN_MASK };

struct mask_run {
  struct ow_case d;
  uint8_t masked[OW_MAXW];
  int how;
  uint32_t dead; /* a rank that makes no call at all (UINT32_MAX: none) */
  /* With d.sc.fp8: every rank's throughput FP8 inputs (any bytes; scales) and the masked
   * oracle's dispatch of them. */
  uint8_t *x8[OW_MAXW];
  float *scales[OW_MAXW];
  struct ref_dispatch_out disp8[OW_MAXW];
};

/* A throughput FP8 dispatch of rank r's x8 into o (recv_x as bytes, scales into sc). */
static int fp8_dispatch(struct ops_ctx *c, const struct mask_run *m, struct ow_outs *o,
                        float *sc) {
  const struct ow_case *d = &m->d;
  const uint32_t r = c->rank;
  struct dep_dispatch_args da = {.size = sizeof da, .x = m->x8[r], .topk_idx = d->idx[r],
                                 .index_type = d->sc.itype,
                                 .topk_weights = d->in[r].topk_weights,
                                 .num_tokens = d->in[r].num_tokens, .recv_x = o->rx,
                                 .recv_topk_idx = o->ridx, .recv_topk_weights = o->rw,
                                 .recv_count_per_expert = o->cnt, .num_recv = &o->num_recv,
                                 .use_fp8 = 1, .x_scales = m->scales[r], .recv_x_scales = sc};
  return host_ops_dispatch(c, &da, &o->h);
}

/* The FP8 rows, their scales and ids against the masked oracle's, bit for bit. */
static int fp8_round(struct ops_ctx *c, const struct mask_run *m, struct ow_outs *o, float *sc,
                     char *msg) {
  const struct ow_case *d = &m->d;
  const struct ref_dispatch_out *e = &m->disp8[c->rank];
  const uint32_t h = d->sc.hidden, G = h / 128, K = d->sc.topk;
  int rc = fp8_dispatch(c, m, o, sc);
  if (rc != 0)
    return ow_fail(msg, "fp8 dispatch returned %s: %s [%s]", dep_errname(rc), c->why, d->desc);
  if (o->num_recv != e->num_recv)
    return ow_fail(msg, "fp8 dispatch: num_recv %u, want %u [%s]", o->num_recv, e->num_recv,
                   d->desc);
  if (memcmp(o->rx, e->x8, (size_t)e->num_recv * h) != 0 ||
      memcmp(sc, e->scales, (size_t)e->num_recv * G * sizeof *sc) != 0 ||
      memcmp(o->ridx, e->topk_idx, (size_t)e->num_recv * K * 4) != 0)
    return ow_fail(msg, "fp8 dispatch: rows, scales or ids differ from the masked oracle [%s]",
                   d->desc);
  return 0;
}

/* The (token, k) pairs of in whose expert is on a masked rank: what a dispatch drops. */
static uint64_t pairs_dropped(const struct ow_case *d, const struct ref_rank_in *in,
                              const uint8_t *masked, int self_masked) {
  uint64_t n = 0;
  for (size_t i = 0; i < (size_t)in->num_tokens * d->sc.topk; i++) {
    const int64_t e = in->topk_idx[i];
    n += e >= 0 && (self_masked || masked[e / d->le]);
  }
  return n;
}

/* A masked rank that is alive masks itself too: each call completes receiving nothing and
 * combining zeros, and drops every pair it had. */
static int masked_rank_rounds(struct ops_ctx *c, const struct mask_run *m, char *msg) {
  const struct ow_case *d = &m->d;
  const uint32_t r = c->rank, h = d->sc.hidden;
  struct ow_outs o;
  ow_outs_alloc(&o, d);
  float *sc = malloc(o.rows_tp * (h / 128) * sizeof *sc);
  int rc = 0;
  for (int round = 0; round < 2 && rc == 0; round++) {
    int e8 = d->sc.fp8 ? fp8_dispatch(c, m, &o, sc) : 0;
    if (e8 != 0 || (d->sc.fp8 && o.num_recv != 0)) {
      rc = ow_fail(msg, "masked rank's fp8 dispatch: %s, %u rows: %s [%s]", dep_errname(e8),
                   o.num_recv, c->why, d->desc);
      break;
    }
    int e = ow_dispatch(c, d, &o, &o.h);
    if (e != 0 || o.num_recv != 0 || o.h.dropped != pairs_dropped(d, &d->in[r], m->masked, 1)) {
      rc = ow_fail(msg, "masked rank's dispatch: %s, %u rows, %llu dropped: %s [%s]",
                   dep_errname(e), o.num_recv, (unsigned long long)o.h.dropped, c->why, d->desc);
      break;
    }
    memset(o.out, 0x5A, (size_t)d->sc.max_tokens * h * 2);
    struct dep_combine_args ca = {.size = sizeof ca, .x = d->cx[r], .out = o.out};
    if ((e = host_ops_combine(c, &ca, &o.h)) != 0 ||
        !ow_all_zero((const uint8_t *)o.out, (size_t)d->in[r].num_tokens * h * 2)) {
      rc = ow_fail(msg, "masked rank's combine: %s, or not zeros: %s [%s]", dep_errname(e),
                   c->why, d->desc);
      break;
    }
    if ((e = ow_ll_dispatch(c, d, &o, d->sc.fp8)) != 0 ||
        !ow_all_zero((const uint8_t *)o.lcnt, d->le * 4)) {
      rc = ow_fail(msg, "masked rank's ll_dispatch: %s, or rows received: %s [%s]",
                   dep_errname(e), c->why, d->desc);
      break;
    }
    memset(o.lout, 0x5A, (size_t)d->max_ll * h * 2);
    struct dep_ll_combine_args lc = {sizeof lc, d->lx[r], d->idx[r], d->sc.itype,
                                     d->in_ll[r].topk_weights, o.lout, 0, NULL};
    if ((e = host_ops_ll_combine(c, &lc, &o.h)) != 0 ||
        !ow_all_zero((const uint8_t *)o.lout, (size_t)d->in_ll[r].num_tokens * h * 2))
      rc = ow_fail(msg, "masked rank's ll_combine: %s, or not zeros: %s [%s]", dep_errname(e),
                   c->why, d->desc);
  }
  free(sc);
  ow_outs_free(&o);
  return rc;
}

/* Every rank: mask as the run says, then two rounds of both modes; a live rank's outputs
 * against the masked oracle, and its handle's dropped pairs against the oracle's count. */
static int mask_rank(struct ops_ctx *c, void *arg, char *msg) {
  const struct mask_run *m = arg;
  const struct ow_case *d = &m->d;
  const uint32_t r = c->rank, W = d->sc.world;
  if (r == m->dead)
    return 0; /* gone before its first call; its abort words are never written */
  if (m->how == BY_LIVE_BIT)
    write_live_mask(c->slabs[r], &c->lay, m->masked, W, 1);
  else
    for (uint32_t q = 0; q < W; q++)
      if (m->masked[q] && host_ops_mask_update(c, q, 1) != 0)
        return ow_fail(msg, "mask_update(%u): %s", q, c->why);
  if (m->masked[r])
    return masked_rank_rounds(c, m, msg);
  struct ow_outs o;
  ow_outs_alloc(&o, d);
  float *sc = malloc(o.rows_tp * (d->sc.hidden / 128) * sizeof *sc);
  uint64_t dig = 0;
  int rc = 0;
  for (int round = 0; round < 2 && rc == 0; round++) {
    uint8_t pz = round ? 0x5A : 0xA5;
    if (d->sc.fp8 && (rc = fp8_round(c, m, &o, sc, msg)) != 0)
      break;
    if ((rc = ow_round_tp(c, d, &o, pz, &dig, msg)) != 0)
      break;
    if (o.h.dropped != pairs_dropped(d, &d->in[r], m->masked, 0)) {
      rc = ow_fail(msg, "dispatch dropped %llu pairs, want %llu [%s]",
                   (unsigned long long)o.h.dropped,
                   (unsigned long long)pairs_dropped(d, &d->in[r], m->masked, 0), d->desc);
      break;
    }
    if ((rc = ow_round_ll(c, d, &o, pz, &dig, msg)) != 0)
      break;
    if (o.h.dropped != pairs_dropped(d, &d->in_ll[r], m->masked, 0))
      rc = ow_fail(msg, "ll_dispatch dropped %llu pairs, want %llu [%s]",
                   (unsigned long long)o.h.dropped,
                   (unsigned long long)pairs_dropped(d, &d->in_ll[r], m->masked, 0), d->desc);
  }
  free(sc);
  ow_outs_free(&o);
  return rc;
}

/* world, fp8, how, masked ranks (a bit each) */
static const struct {
  uint32_t world;
  int fp8, how;
  uint32_t masked;
} mask_cases[] = {
  {4, 0, BY_LIVE_BIT, 1u << 3},
  {4, 1, BY_OWN_MASK, 1u << 1},
  {8, 1, BY_LIVE_BIT, (1u << 2) | (1u << 5)},
  {8, 0, BY_OWN_MASK, 1u << 0},
  {5, 1, BY_LIVE_BIT, 1u << 4},
};

static struct mask_run *mask_run_make(uint32_t i, uint32_t dead) {
  struct mask_run *m = calloc(1, sizeof *m);
  ck_assert_ptr_nonnull(m);
  const uint32_t W = mask_cases[i].world;
  const struct ow_scenario sc = {W, 256, 4, 4 * W, 16, 8, P_RANDOM, T_MIXED,
                                 i % 2 ? DEP_INDEX_I32 : DEP_INDEX_I64, mask_cases[i].fp8};
  ow_case_make(&m->d, &sc, sc.fp8);
  for (uint32_t r = 0; r < W; r++)
    m->masked[r] = (mask_cases[i].masked >> r) & 1u;
  m->how = mask_cases[i].how;
  m->dead = dead;
  ow_case_mask(&m->d, m->masked);
  if (sc.fp8) {
    struct ref_rank_in in8[OW_MAXW];
    ck_assert_int_eq(ref_mask(&m->d.shape, W, m->d.in, m->masked, in8), 0);
    for (uint32_t r = 0; r < W; r++) {
      const size_t n = m->d.in[r].num_tokens, h = sc.hidden;
      m->x8[r] = malloc(n * h + 1);
      m->scales[r] = malloc((n * (h / 128) + 1) * sizeof(float));
      ck_assert(m->x8[r] && m->scales[r]);
      for (size_t j = 0; j < n * h; j++)
        m->x8[r][j] = (uint8_t)ow_rnd(); /* moved as bytes: any code */
      for (size_t j = 0; j < n * (h / 128); j++)
        m->scales[r][j] = ow_unif() + 1e-3f;
      in8[r].x8 = m->x8[r];
      in8[r].scales = m->scales[r];
    }
    ck_assert_int_eq(ref_dispatch(&m->d.shape, W, in8, m->disp8), 0);
    ref_mask_free(in8, W);
  }
  snprintf(m->d.desc + strlen(m->d.desc), sizeof m->d.desc - strlen(m->d.desc),
           ", masked %#x by %s", mask_cases[i].masked,
           m->how == BY_LIVE_BIT ? "live bit" : "own mask");
  return m;
}

static void mask_run_free(struct mask_run *m) {
  if (m->d.sc.fp8)
    ref_dispatch_free(m->disp8, m->d.sc.world);
  for (uint32_t r = 0; r < m->d.sc.world; r++) {
    free(m->x8[r]);
    free(m->scales[r]);
  }
  ow_case_free(&m->d);
  free(m);
}

/* A masked rank gets nothing and waits for no one; the other ranks' every output matches
 * the oracle with it masked (the old code sent to and waited for it: other outputs). */
START_TEST(a_masked_rank_is_skipped_and_the_rest_match_the_masked_oracle) {
  ow_seed_init((uint64_t)_i);
  struct mask_run *m = mask_run_make((uint32_t)_i, UINT32_MAX);
  ow_run_ranks(&m->d.shape, m->d.sc.world, mask_rank, m, m->d.desc);
  mask_run_free(m);
}
END_TEST

/* A masked rank that is dead (it never makes a call) in a job whose abort words are never
 * written, as an elastic job's: the others' calls complete against the masked oracle (the
 * old code waited for it until the op timeout). */
START_TEST(a_dead_masked_rank_stops_no_one_without_abort_words) {
  ow_seed_init(100 + (uint64_t)_i);
  const uint32_t i = _i == 0 ? 0 : 2;
  struct mask_run *m = mask_run_make(i, mask_cases[i].world - 1 - (uint32_t)(2 * _i));
  ck_assert(m->masked[m->dead]);
  ow_run_ranks(&m->d.shape, m->d.sc.world, mask_rank, m, m->d.desc);
  mask_run_free(m);
}
END_TEST

/* ---- a rank masked while a wait waits for it --------------------------------------- */

struct later {
  uint8_t *slab;
  const struct dep_slab_layout *lay;
  uint8_t masked[OW_MAXW];
  uint32_t world;
};

/* The daemon's part, from another thread: the bit, then the epoch. */
static void *mask_later(void *arg) {
  struct later *l = arg;
  /* Not synchronisation: the call waits until the bit comes whatever the delay; this only
   * makes the common case the one where it is already waiting. */
  struct timespec ts = {0, 50 * 1000000};
  nanosleep(&ts, NULL);
  write_live_mask(l->slab, l->lay, l->masked, l->world, 7);
  return NULL;
}

/* Rank 0 of a world of 3 in the test's process, rank 2 never coming: its dispatch (_i 0:
 * throughput, 1: low-latency) waits for rank 2 until the daemon writes rank 2's bit, then
 * completes with it masked and matches the masked oracle; the calls after it too (the old
 * code waited out the op timeout: DEP_ERR_TIMEOUT). */
START_TEST(a_wait_for_a_rank_masked_mid_wait_completes) {
  ow_seed_init(200 + (uint64_t)_i);
  static const struct ow_scenario three = {3, 128, 2, 6, 4, 4, P_RANDOM, T_MAX, DEP_INDEX_I64,
                                           0};
  struct ow_rank0 *g = ow_rank0_open(&three, OW_TIMEOUT_MS);
  uint8_t masked[3] = {0, 0, 1};
  ow_case_mask(&g->d, masked);
  /* Rank 1 is live and makes the same calls, its bit for rank 2 written first; only rank 2
   * is gone. */
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) {
    struct ops_ctx c1;
    char why[256], msg[OW_MSG] = "";
    if (host_ops_init(&c1, &g->d.shape, 3, 1, g->w.slabs, OW_TIMEOUT_MS, why, sizeof why) != 0)
      _exit(2);
    write_live_mask(g->w.slabs[1], &c1.lay, masked, 3, 7);
    struct ow_outs o;
    ow_outs_alloc(&o, &g->d);
    uint64_t dig = 0;
    int rc = _i == 0 ? ow_round_tp(&c1, &g->d, &o, 0xA5, &dig, msg)
                     : ow_round_ll(&c1, &g->d, &o, 0xA5, &dig, msg);
    if (rc != 0)
      fprintf(stderr, "rank 1: %s\n", msg);
    _exit(rc);
  }
  struct later l = {g->w.slabs[0], &g->c.lay, {0, 0, 1}, 3};
  pthread_t th;
  ck_assert_int_eq(pthread_create(&th, NULL, mask_later, &l), 0);
  char msg[OW_MSG] = "";
  uint64_t dig = 0;
  int rc = _i == 0 ? ow_round_tp(&g->c, &g->d, &g->o, 0xA5, &dig, msg)
                   : ow_round_ll(&g->c, &g->d, &g->o, 0xA5, &dig, msg);
  pthread_join(th, NULL);
  int st = 0;
  ck_assert_int_eq(waitpid(pid, &st, 0), pid);
  ck_assert_msg(rc == 0, "rank 0: %s (seed %llu)", msg, (unsigned long long)ow_seed);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "rank 1 failed (seed %llu)",
                (unsigned long long)ow_seed);
  ck_assert_uint_eq(g->c.epoch, 7);
  ow_rank0_close(g);
}
END_TEST

/* Rank 0 of a world of 2 in the test's process; rank 1's part of call 1, written by hand as
 * a sender that dies mid-stream writes it: its slot (2 rows), its first row and the tail
 * after it, then nothing.  Rank 0's dispatch waits for the second row until the daemon writes
 * rank 1's bit: it completes, rank 1's first row in its place, the second zeros with ids -1
 * and weights 0 (the old code waited out the op timeout: DEP_ERR_TIMEOUT). */
START_TEST(a_rank_masked_mid_stream_leaves_its_missing_rows_zero) {
  static const struct ow_scenario two = {2, 128, 2, 4, 4, 4, P_RANDOM, T_MAX, DEP_INDEX_I64, 0};
  struct ow_rank0 *g = ow_rank0_open(&two, OW_TIMEOUT_MS);
  const uint32_t h = 128, K = 2, parity = 1;
  uint8_t *slab0 = g->w.slabs[0];
  uint8_t *row = slab0 + dep_slab_row(&g->w.lay, parity, 1, 0);
  for (uint32_t i = 0; i < h; i++)
    ((uint16_t *)row)[i] = (uint16_t)(0x3f80 + i); /* bf16 payload: any bits */
  int32_t *meta = (int32_t *)(row + ops_meta_off(h));
  meta[0] = 3; /* its token 3 */
  meta[1] = (int32_t)K;
  int32_t *ids = (int32_t *)(row + ops_ids_off(h));
  float *w = (float *)(row + ops_weights_off(h, K));
  ids[0] = 1, ids[1] = -1; /* local expert 1 of rank 0, and an expert of rank 1 */
  w[0] = 0.25f, w[1] = 0.0f;
  struct ops_slot *sl = (struct ops_slot *)(slab0 + dep_slab_ctrl_slot(&g->w.lay, parity, 1));
  sl->rows = 2;
  sl->op = OPS_OP_DISPATCH;
  sl->ref_seq = 0;
  sl->num_tokens = 4;
  atomic_store_explicit(&sl->flag, 1, memory_order_release);
  atomic_store_explicit(&sl->tail, DEP_SLAB_CHAN_AT(1, 1), memory_order_release);
  uint8_t masked[2] = {0, 1};
  ow_case_mask(&g->d, masked); /* rank 0's own rows: the masked oracle's */
  struct later l = {slab0, &g->c.lay, {0, 1}, 2};
  pthread_t th;
  ck_assert_int_eq(pthread_create(&th, NULL, mask_later, &l), 0);
  memset(g->o.rx, 0xA5, g->o.rows_tp * h * 2);
  int rc = ow_dispatch(&g->c, &g->d, &g->o, &g->o.h);
  pthread_join(th, NULL);
  ck_assert_msg(rc == 0, "dispatch: %s: %s", dep_errname(rc), g->c.why);
  const struct ref_dispatch_out *e = &g->d.disp[0];
  const uint32_t n0 = e->num_recv;
  ck_assert_uint_eq(g->o.num_recv, n0 + 2);
  ck_assert_uint_eq(g->o.h.recv_from[1], 2);
  ck_assert(memcmp(g->o.rx, e->x, (size_t)n0 * h * 2) == 0);
  ck_assert(memcmp(g->o.ridx, e->topk_idx, (size_t)n0 * K * 4) == 0);
  ck_assert(memcmp(g->o.rx + (size_t)n0 * h, row, h * 2) == 0);
  ck_assert_int_eq(g->o.ridx[(size_t)n0 * K], 1);
  ck_assert_int_eq(g->o.ridx[(size_t)n0 * K + 1], -1);
  ck_assert(g->o.rw[(size_t)n0 * K] == 0.25f);
  ck_assert(ow_all_zero((const uint8_t *)(g->o.rx + (size_t)(n0 + 1) * h), h * 2));
  ck_assert_int_eq(g->o.ridx[(size_t)(n0 + 1) * K], -1);
  ck_assert_int_eq(g->o.ridx[(size_t)(n0 + 1) * K + 1], -1);
  ck_assert(g->o.rw[(size_t)(n0 + 1) * K] == 0.0f && g->o.rw[(size_t)(n0 + 1) * K + 1] == 0.0f);
  ow_rank0_close(g);
}
END_TEST

/* ---- the C API through a real daemon ------------------------------------------------ */

#define EXPECT_RC(call, want)                                                                \
  do {                                                                                       \
    int rc_ = (call);                                                                        \
    ck_assert_msg(rc_ == (want), "%s: %s (%s), want %s", #call, dep_errname(rc_),            \
                  dep_errmsg(c), dep_errname(want));                                         \
  } while (0)

/* dep_mask_update, dep_mask_clear and dep_mask_query on one attached rank of the host
 * backend: refusals first (not attached, a rank past the world, masked not 0 or 1, a short
 * or NULL out, a handle with no dispatch), then the own mask and the live mask (written
 * into the slab as the daemon writes it) each seen by the query, the epoch with it. */
START_TEST(the_mask_calls_refuse_bad_arguments_and_query_both_masks) {
  struct tu_daemon dm;
  ck_assert_int_eq(tu_daemon_start(&dm, NULL), 0);
  dep_client_t *c = cl_connect(dm.sock);
  int32_t q[2] = {7, 7};
  uint64_t epoch = 99, pairs = 0;
  EXPECT_RC(dep_mask_update(c, 0, 1), DEP_ERR_STATE);
  EXPECT_RC(dep_mask_query(c, q, 2, &epoch), DEP_ERR_STATE);
  struct dep_attach_args a = cl_attach_args("mask-api", 0);
  a.world_size = a.local_world_size = 1;
  EXPECT_RC(dep_attach(c, &a), DEP_OK);
  EXPECT_RC(dep_mask_update(c, 1, 1), DEP_ERR_INVALID);
  ck_assert_ptr_nonnull(strstr(dep_errmsg(c), "rank 1"));
  EXPECT_RC(dep_mask_update(c, 0, 2), DEP_ERR_INVALID);
  EXPECT_RC(dep_mask_query(c, q, 0, &epoch), DEP_ERR_INVALID);
  EXPECT_RC(dep_mask_query(c, NULL, 1, &epoch), DEP_ERR_INVALID);
  dep_handle_t *h = NULL;
  EXPECT_RC(dep_handle_new(c, &h), DEP_OK);
  EXPECT_RC(dep_handle_dropped(c, h, &pairs), DEP_ERR_INVALID);
  EXPECT_RC(dep_handle_dropped(c, h, NULL), DEP_ERR_INVALID);
  EXPECT_RC(dep_mask_query(c, q, 2, &epoch), DEP_OK);
  ck_assert_int_eq(q[0], 0);
  ck_assert_int_eq(q[1], 7); /* past the world: not written */
  ck_assert_uint_eq(epoch, 0);
  EXPECT_RC(dep_mask_update(c, 0, 1), DEP_OK);
  EXPECT_RC(dep_mask_query(c, q, 1, NULL), DEP_OK);
  ck_assert_int_eq(q[0], 1);
  EXPECT_RC(dep_mask_clear(c), DEP_OK);
  EXPECT_RC(dep_mask_query(c, q, 1, &epoch), DEP_OK);
  ck_assert_int_eq(q[0], 0);
  /* The live mask, as the daemon writes it: the query or-s it in, with its epoch. */
  struct dep_attach_info info = {.size = sizeof info};
  EXPECT_RC(dep_attach_info(c, &info), DEP_OK);
  struct dep_slab_layout lay;
  char why[256];
  ck_assert_int_eq(dep__slab_layout(&a.shape, 1, &lay, why, sizeof why), 0);
  const uint8_t one[1] = {1};
  write_live_mask(info.slabs[0], &lay, one, 1, 3);
  EXPECT_RC(dep_mask_query(c, q, 1, &epoch), DEP_OK);
  ck_assert_int_eq(q[0], 1);
  ck_assert_uint_eq(epoch, 3);
  EXPECT_RC(dep_mask_clear(c), DEP_OK); /* the rank's own: the live bit stays */
  EXPECT_RC(dep_mask_query(c, q, 1, &epoch), DEP_OK);
  ck_assert_int_eq(q[0], 1);
  dep_handle_free(h);
  dep_client_free(c);
  ck_assert_int_eq(tu_daemon_stop(&dm), 0);
  tu_daemon_cleanup(&dm);
}
END_TEST

/* dep_next_call succeeds and gives want. */
#define EXPECT_NEXT(want)                                                                    \
  do {                                                                                       \
    uint64_t n_ = 0;                                                                         \
    EXPECT_RC(dep_next_call(c, &n_), DEP_OK);                                                \
    ck_assert_msg(n_ == (want), "dep_next_call gave %llu, want %llu", (unsigned long long)n_, \
                  (unsigned long long)(want));                                               \
  } while (0)

/* dep_next_call on one attached rank of the host backend: 1 after the attach, one more for
 * each dispatch, combine, LL dispatch and LL combine, none for a layout, the mask calls or a
 * call refused before it ran, 1 again in the next attachment; and its refusals (a NULL
 * client or call, not attached). */
START_TEST(the_next_call_is_one_then_grows_by_one_per_communicating_call) {
  struct tu_daemon dm;
  ck_assert_int_eq(tu_daemon_start(&dm, NULL), 0);
  dep_client_t *c = cl_connect(dm.sock);
  uint64_t n = 99;
  ck_assert_int_eq(dep_next_call(NULL, &n), DEP_ERR_INVALID);
  EXPECT_RC(dep_next_call(c, &n), DEP_ERR_STATE);
  ck_assert_uint_eq(n, 99);
  struct dep_attach_args a = cl_attach_args("next-call", 0);
  a.world_size = a.local_world_size = 1;
  a.shape.max_tokens_per_rank = 4;
  EXPECT_RC(dep_attach(c, &a), DEP_OK);
  EXPECT_RC(dep_next_call(c, NULL), DEP_ERR_INVALID);
  EXPECT_NEXT(1);
  /* 4 tokens of the one rank, each to 2 of its 8 experts. */
  int32_t idx[8] = {0, 1, 2, 3, 4, 5, 6, 7}, cnt[8], lcnt[8], per_rank[1], per_expert[8];
  float w[8] = {1, 1, 1, 1, 1, 1, 1, 1}, rw[8];
  static uint16_t x[4 * 256], rx[8 * 256], out[4 * 256], lx[8 * 4 * 256];
  int32_t ridx[16];
  uint8_t in_rank[4];
  uint32_t nr = 0;
  const struct dep_layout_args la = {.size = sizeof la, .topk_idx = idx,
                                     .index_type = DEP_INDEX_I32, .num_tokens = 4,
                                     .tokens_per_rank = per_rank, .tokens_per_expert = per_expert,
                                     .token_in_rank = in_rank};
  const struct dep_dispatch_args da = {.size = sizeof da, .x = x, .topk_idx = idx,
                                       .index_type = DEP_INDEX_I32, .topk_weights = w,
                                       .num_tokens = 4, .recv_x = rx, .recv_topk_idx = ridx,
                                       .recv_topk_weights = rw, .recv_count_per_expert = cnt,
                                       .num_recv = &nr};
  const struct dep_combine_args ca = {.size = sizeof ca, .x = rx, .out = out};
  const struct dep_ll_dispatch_args ld = {.size = sizeof ld, .x = x, .topk_idx = idx,
                                          .index_type = DEP_INDEX_I32, .num_tokens = 4,
                                          .recv_x = lx, .recv_count = lcnt};
  const struct dep_ll_combine_args lc = {.size = sizeof lc, .x = lx, .topk_idx = idx,
                                         .index_type = DEP_INDEX_I32, .topk_weights = w,
                                         .out = out};
  dep_handle_t *h = NULL, *hl = NULL, *empty = NULL;
  EXPECT_RC(dep_handle_new(c, &h), DEP_OK);
  EXPECT_RC(dep_handle_new(c, &hl), DEP_OK);
  EXPECT_RC(dep_handle_new(c, &empty), DEP_OK);
  EXPECT_RC(dep_layout(c, &la, NULL), DEP_OK);
  EXPECT_NEXT(1);
  EXPECT_RC(dep_dispatch(c, &da, h, NULL), DEP_OK);
  EXPECT_NEXT(2);
  EXPECT_RC(dep_combine(c, &ca, h, NULL), DEP_OK);
  EXPECT_NEXT(3);
  EXPECT_RC(dep_ll_dispatch(c, &ld, hl, NULL), DEP_OK);
  EXPECT_NEXT(4);
  EXPECT_RC(dep_ll_combine(c, &lc, hl, NULL), DEP_OK);
  EXPECT_NEXT(5);
  EXPECT_RC(dep_combine(c, &ca, empty, NULL), DEP_ERR_INVALID); /* refused: it holds no dispatch */
  int32_t q[1];
  EXPECT_RC(dep_mask_update(c, 0, 0), DEP_OK);
  EXPECT_RC(dep_mask_query(c, q, 1, NULL), DEP_OK);
  EXPECT_NEXT(5);
  EXPECT_RC(dep_detach(c), DEP_OK);
  EXPECT_RC(dep_next_call(c, &n), DEP_ERR_STATE);
  snprintf(a.job_id, sizeof a.job_id, "next-call-2");
  EXPECT_RC(dep_attach(c, &a), DEP_OK);
  EXPECT_NEXT(1);
  dep_handle_free(h);
  dep_handle_free(hl);
  dep_handle_free(empty);
  dep_client_free(c);
  ck_assert_int_eq(tu_daemon_stop(&dm), 0);
  tu_daemon_cleanup(&dm);
}
END_TEST

Suite *ops_mask_suite(void);
Suite *ops_mask_suite(void) {
  Suite *s = suite_create("ops_mask");
  TCase *t = tcase_create("masks");
  tcase_set_timeout(t, 120);
  tcase_add_loop_test(t, a_masked_rank_is_skipped_and_the_rest_match_the_masked_oracle, 0,
                      (int)(sizeof mask_cases / sizeof mask_cases[0]));
  tcase_add_loop_test(t, a_dead_masked_rank_stops_no_one_without_abort_words, 0, 2);
  tcase_add_loop_test(t, a_wait_for_a_rank_masked_mid_wait_completes, 0, 2);
  tcase_add_test(t, a_rank_masked_mid_stream_leaves_its_missing_rows_zero);
  suite_add_tcase(s, t);
  TCase *api = tcase_create("api");
  tcase_set_timeout(api, 60);
  tcase_add_test(api, the_mask_calls_refuse_bad_arguments_and_query_both_masks);
  tcase_add_test(api, the_next_call_is_one_then_grows_by_one_per_communicating_call);
  suite_add_tcase(s, api);
  return s;
}
