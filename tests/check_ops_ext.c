/*
 * check_ops_ext.c — the host backend's throughput extensions as a
 * specification (DESIGN §6, deep_ep's calls): FP8 dispatch with its scales,
 * cached mode through a handle, num_worst_tokens (outputs of that many rows,
 * padded), expert_alignment, a weighted combine and received ids as int64
 * or int32, each against the reference oracle in real rank processes; the
 * faults of cached and worst-case calls keep the ranks in step; bad
 * arguments are refused before anything is written.  The plain operations
 * are check_ops.c's.
 *
 * Inputs are fresh random data each run; a failure prints the seed, and
 * DEP_TEST_SEED=<seed> replays it.
 */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "host_ops.h"
#include "opsworld.h"
#include "ref.h"

/* ---- throughput extensions: FP8, cached mode, worst-case rows, alignment, weights -- */

/* A case with FP8 inputs beside the bf16 ones, combine weights, and their oracle. */
struct ext_case {
  struct ow_case d;
  uint32_t align[OW_MAXW], worst[OW_MAXW];
  uint8_t *x8[OW_MAXW];
  float *scales[OW_MAXW];
  float *cw[OW_MAXW];           /* combine's weights: [num_recv, topk] per rank */
  struct ref_dispatch_out disp8[OW_MAXW];
  struct ref_sum wsum[OW_MAXW]; /* the oracle's combined weights */
};

static void ext_make(struct ext_case *e, const struct ow_scenario *sc) {
  memset(e, 0, sizeof *e);
  struct ow_case *d = &e->d;
  ow_case_make(d, sc, 0);
  const uint32_t W = sc->world, h = sc->hidden, K = sc->topk;
  struct ref_rank_in in8[OW_MAXW];
  static const uint32_t aligns[] = {0, 1, 2, 3, 128};
  for (uint32_t r = 0; r < W; r++) {
    uint32_t n = d->in[r].num_tokens;
    e->x8[r] = malloc((size_t)n * h + 1);
    e->scales[r] = malloc(((size_t)n * (h / 128) + 1) * 4);
    ck_assert(e->x8[r] && e->scales[r]);
    for (size_t i = 0; i < (size_t)n * h; i++)
      e->x8[r][i] = (uint8_t)ow_rnd(); /* moved as bytes: any code, NaN included */
    for (size_t i = 0; i < (size_t)n * (h / 128); i++)
      e->scales[r][i] = ow_unif() + 1e-3f;
    in8[r] = d->in[r];
    in8[r].x8 = e->x8[r];
    in8[r].scales = e->scales[r];
    e->align[r] = aligns[ow_below(5)];
  }
  ck_assert_int_eq(ref_dispatch(&d->shape, W, in8, e->disp8), 0);
  for (uint32_t r = 0; r < W; r++) {
    uint32_t nr = d->disp[r].num_recv, cap = W * sc->max_tokens;
    e->worst[r] = nr + ow_below(cap - nr + 1); /* anywhere from exact to the capacity */
    e->worst[r] += e->worst[r] == 0;            /* 0 would mean none */
    e->cw[r] = malloc(((size_t)nr * K + 1) * 4);
    ck_assert(e->cw[r]);
    for (size_t i = 0; i < (size_t)nr * K; i++)
      e->cw[r][i] = ow_unif() * 2.0f - 1.0f;
  }
  ck_assert_int_eq(ref_combine_weights(&d->shape, W, d->in, d->disp,
                                       (const float *const *)e->cw, e->wsum), 0);
}

static void ext_free(struct ext_case *e) {
  uint32_t W = e->d.sc.world;
  for (uint32_t r = 0; r < W; r++)
    free(e->x8[r]), free(e->scales[r]), free(e->cw[r]);
  ref_dispatch_free(e->disp8, W);
  ref_sum_free(e->wsum, W);
  ow_case_free(&e->d);
}

/* The received rows of a dispatch (bf16, or FP8 bytes and scales) against the oracle's. */
static int ext_rows(const struct ext_case *e, uint32_t r, const void *rx, const float *rs,
                    uint32_t n, int fp8, const char *what, char *msg) {
  const struct ow_case *d = &e->d;
  const uint32_t h = d->sc.hidden, G = h / 128;
  const struct ref_dispatch_out *want = fp8 ? &e->disp8[r] : &d->disp[r];
  if (n != want->num_recv)
    return ow_fail(msg, "%s: %u rows, want %u [%s]", what, n, want->num_recv, d->desc);
  for (uint32_t i = 0; i < n; i++) {
    int bad = fp8 ? memcmp((const uint8_t *)rx + (size_t)i * h, want->x8 + (size_t)i * h, h) != 0 ||
                        memcmp(rs + (size_t)i * G, want->scales + (size_t)i * G, G * 4) != 0
                  : memcmp((const uint16_t *)rx + (size_t)i * h, want->x + (size_t)i * h, h * 2) != 0;
    if (bad)
      return ow_fail(msg, "%s: row %u is not token %u of rank %u%s [%s]", what, i,
                     want->from[i].token, want->from[i].rank, fp8 ? " (e4m3 bytes and scales)" : "",
                     d->desc);
  }
  return 0;
}

#define EXT_CALL(expr, what)                                                                 \
  do {                                                                                       \
    int rc_ = (expr);                                                                        \
    if (rc_ != 0)                                                                            \
      return ow_fail(msg, "%s returned %s: %s [%s]", what, dep_errname(rc_), c->why, d->desc); \
  } while (0)

/*
 * FP8 dispatch with num_worst_tokens and expert_alignment, then a cached
 * bf16 dispatch through its handle, a combine with weights, and a cached
 * FP8 dispatch with num_worst_tokens: each against the oracle, twice.
 */
static int ext_rank(struct ops_ctx *c, void *arg, char *msg) {
  const struct ext_case *e = arg;
  const struct ow_case *d = &e->d;
  const uint32_t r = c->rank, h = d->sc.hidden, K = d->sc.topk, G = h / 128;
  const struct ref_rank_in *in = &d->in[r];
  const struct ref_dispatch_out *want = &d->disp[r];
  struct ow_outs o;
  ow_outs_alloc(&o, d);
  const size_t rows = o.rows_tp;
  uint8_t *rx8 = malloc(rows * h + 1);
  float *rs = malloc(rows * G * 4 + 4), *ow = malloc(((size_t)d->sc.max_tokens * K + 1) * 4);
  int32_t cnt[256];
  int rc = 0;
  for (int round = 0; round < 2 && rc == 0; round++) {
    const uint8_t pz = round ? 0x5A : 0xA5;
    const uint32_t worst = e->worst[r];
    memset(rx8, pz, rows * h);
    memset(rs, pz, rows * G * 4);
    memset(o.ridx, pz, rows * K * 4);
    memset(o.rw, pz, rows * K * 4);
    struct dep_dispatch_args a = {
        .size = sizeof a, .x = e->x8[r], .x_scales = e->scales[r], .use_fp8 = 1,
        .topk_idx = d->idx[r], .index_type = d->sc.itype, .topk_weights = in->topk_weights,
        .num_tokens = in->num_tokens, .recv_x = rx8, .recv_x_scales = rs,
        .recv_topk_idx = o.ridx, .recv_topk_weights = o.rw, .recv_count_per_expert = cnt,
        .num_worst_tokens = worst, .expert_alignment = e->align[r]};
    EXT_CALL(host_ops_dispatch(c, &a, &o.h), "dispatch (fp8, num_worst_tokens)");
    const uint32_t n = want->num_recv;
    if ((rc = ext_rows(e, r, rx8, rs, n, 1, "dispatch (fp8)", msg)) != 0)
      break;
    if (memcmp(o.ridx, want->topk_idx, (size_t)n * K * 4) != 0 ||
        memcmp(o.rw, want->topk_weights, (size_t)n * K * 4) != 0)
      return ow_fail(msg, "dispatch (fp8): ids or weights differ from the oracle [%s]", d->desc);
    for (size_t i = (size_t)n * K; i < (size_t)worst * K; i++)
      if (o.ridx[i] != -1 || o.rw[i] != 0.0f)
        return ow_fail(msg, "dispatch: padding row %zu of %u (num_recv %u) has id %d weight %g, "
                       "want -1 and 0 [%s]", i / K, worst, n, o.ridx[i], o.rw[i], d->desc);
    if (ow_unpoisoned(o.ridx + (size_t)worst * K, (rows - worst) * K * 4, pz) >= 0 ||
        ow_unpoisoned(rx8 + (size_t)n * h, (rows - n) * h, pz) >= 0 ||
        ow_unpoisoned(rs + (size_t)n * G, (rows - n) * G * 4, pz) >= 0)
      return ow_fail(msg, "dispatch: wrote past its rows (num_recv %u, num_worst_tokens %u) [%s]",
                     n, worst, d->desc);
    int32_t wc[256];
    memcpy(wc, want->count, d->le * 4);
    ref_align_counts(wc, d->le, e->align[r]);
    if (memcmp(cnt, wc, d->le * 4) != 0)
      return ow_fail(msg, "dispatch: recv_count_per_expert differs from the oracle's rounded to "
                     "multiples of %u [%s]", e->align[r], d->desc);

    /* Cached, bf16: the same routing, no ids, the handle unchanged. */
    memset(o.rx, pz, rows * h * 2);
    o.num_recv = ~0u;
    struct dep_dispatch_args cb = {.size = sizeof cb, .cached = 1, .x = in->x,
                                   .num_tokens = in->num_tokens, .recv_x = o.rx,
                                   .num_recv = &o.num_recv, .num_worst_tokens = worst};
    EXT_CALL(host_ops_dispatch(c, &cb, &o.h), "dispatch (cached)");
    if ((rc = ext_rows(e, r, o.rx, NULL, n, 0, "dispatch (cached)", msg)) != 0)
      break;
    if (ow_unpoisoned(o.rx + (size_t)n * h, (rows - n) * h * 2, pz) >= 0)
      return ow_fail(msg, "dispatch (cached): wrote past its %u rows [%s]", n, d->desc);

    /* Combine with weights, through the handle the cached dispatch left as it was. */
    memset(o.out, pz, (size_t)d->sc.max_tokens * h * 2);
    memset(ow, pz, (size_t)d->sc.max_tokens * K * 4);
    struct dep_combine_args ca = {.size = sizeof ca, .x = d->cx[r], .out = o.out,
                                  .topk_weights = e->cw[r], .out_topk_weights = ow};
    EXT_CALL(host_ops_combine(c, &ca, &o.h), "combine (weights)");
    if (ow_check_sum(o.out, &d->comb[r], in->num_tokens, h, "combine", d->desc, msg))
      return 1;
    for (size_t i = 0; i < (size_t)in->num_tokens * K; i++) {
      double v = e->wsum[r].val[i], tol = ldexp(e->wsum[r].mag[i], -20);
      if (!(fabs(ow[i] - v) <= tol))
        return ow_fail(msg, "combine: out_topk_weights[%zu][%zu] = %.9g, want %.9g +- %.3g [%s]",
                       i / K, i % K, ow[i], v, tol, d->desc);
    }
    if (ow_unpoisoned(ow + (size_t)in->num_tokens * K,
                      (size_t)(d->sc.max_tokens - in->num_tokens) * K * 4, pz) >= 0)
      return ow_fail(msg, "combine: out_topk_weights written past num_tokens [%s]", d->desc);

    /* Cached, FP8, its own worst-case rows. */
    memset(rx8, pz, rows * h);
    struct dep_dispatch_args c8 = {.size = sizeof c8, .cached = 1, .use_fp8 = 1, .x = e->x8[r],
                                   .x_scales = e->scales[r], .num_tokens = in->num_tokens,
                                   .recv_x = rx8, .recv_x_scales = rs,
                                   .num_worst_tokens = o.rows_tp};
    EXT_CALL(host_ops_dispatch(c, &c8, &o.h), "dispatch (cached, fp8)");
    rc = ext_rows(e, r, rx8, rs, n, 1, "dispatch (cached, fp8)", msg);
  }
  free(rx8), free(rs), free(ow);
  ow_outs_free(&o);
  return rc;
}

static const struct ow_scenario ext_scenarios[] = {
  /* world hidden topk experts max_tokens max_ll  routing  tokens  index  fp8 */
  {1, 128, 2, 4, 8, 8, P_RANDOM, T_MAX, DEP_INDEX_I64, 0},
  {2, 2048, 8, 8, 16, 16, P_DUP, T_MIXED, DEP_INDEX_I32, 0},
  {4, 256, 4, 16, 32, 8, P_RANDOM, T_MIXED, DEP_INDEX_I64, 0},
  {4, 128, 8, 16, 16, 16, P_NONE, T_MAX, DEP_INDEX_I32, 0},
  {8, 384, 8, 64, 16, 16, P_RANDOM, T_MAX, DEP_INDEX_I64, 0},
  {8, 128, 2, 8, 16, 16, P_ONE_RANK, T_ZERO, DEP_INDEX_I32, 0},
};

/* ext_scenarios[i]'s world, seeded with seed, each rank running fn on the case. */
static void ext_run(int i, uint64_t seed, ow_rank_fn fn) {
  ow_seed_init(seed);
  struct ext_case *e = malloc(sizeof *e);
  ck_assert_ptr_nonnull(e);
  ext_make(e, &ext_scenarios[i]);
  ow_run_ranks(&e->d.shape, e->d.sc.world, fn, e, e->d.desc);
  ext_free(e);
  free(e);
}

/* FP8 dispatch, cached mode, num_worst_tokens, expert_alignment and combined weights. */
START_TEST(throughput_extensions_match_the_oracle) { ext_run(_i, 100 + (uint64_t)_i, ext_rank); }
END_TEST

/*
 * Received ids as int64 (recv_index_type DEP_INDEX_I64) and, explicitly, as
 * int32: each rank dispatches with each type, first with the exact row
 * count, then with num_worst_tokens.  The ids are the oracle's values
 * (the -1 columns of other ranks' experts included), every padding row is
 * -1 in every column of the type's width, the weights are the oracle's,
 * and nothing is written past the rows.
 */
static int wide_ids_rank(struct ops_ctx *c, void *arg, char *msg) {
  const struct ext_case *e = arg;
  const struct ow_case *d = &e->d;
  const uint32_t r = c->rank, K = d->sc.topk;
  const struct ref_rank_in *in = &d->in[r];
  const struct ref_dispatch_out *want = &d->disp[r];
  struct ow_outs o;
  ow_outs_alloc(&o, d);
  const size_t rows = o.rows_tp, cap = rows * K * 8;
  int64_t *ri = malloc(cap + 8);
  ck_assert(ri);
  static const int types[] = {DEP_INDEX_I64, DEP_INDEX_I32};
  int rc = 0;
  for (int round = 0; round < 4 && rc == 0; round++) {
    const int type = types[round & 1];
    const size_t esz = type == DEP_INDEX_I64 ? 8 : 4;
    const uint32_t worst = round < 2 ? 0 : e->worst[r], n = want->num_recv;
    const size_t filled = (size_t)(worst ? worst : n) * K;
    const uint8_t pz = round & 1 ? 0x5A : 0xA5;
    const char *what = type == DEP_INDEX_I64 ? "dispatch (int64 ids)" : "dispatch (int32 ids)";
    memset(ri, pz, cap);
    memset(o.rw, pz, rows * K * 4);
    o.num_recv = ~0u;
    struct dep_dispatch_args a = {
        .size = sizeof a, .x = in->x, .topk_idx = d->idx[r], .index_type = d->sc.itype,
        .topk_weights = in->topk_weights, .num_tokens = in->num_tokens, .recv_x = o.rx,
        .recv_topk_idx = ri, .recv_index_type = type, .recv_topk_weights = o.rw,
        .recv_count_per_expert = o.cnt, .num_recv = &o.num_recv, .num_worst_tokens = worst};
    EXT_CALL(host_ops_dispatch(c, &a, &o.h), what);
    if (worst == 0 && o.num_recv != n)
      return ow_fail(msg, "%s: num_recv %u, want %u [%s]", what, o.num_recv, n, d->desc);
    for (size_t i = 0; i < filled; i++) {
      int64_t got = esz == 8 ? ri[i] : ((const int32_t *)ri)[i];
      int64_t exp = i < (size_t)n * K ? want->topk_idx[i] : -1;
      if (got != exp)
        return ow_fail(msg, "%s: row %zu k %zu (num_recv %u, num_worst_tokens %u): id %lld, "
                       "want %lld [%s]", what, i / K, i % K, n, worst, (long long)got,
                       (long long)exp, d->desc);
    }
    if (memcmp(o.rw, want->topk_weights, (size_t)n * K * 4) != 0)
      return ow_fail(msg, "%s: weights differ from the oracle [%s]", what, d->desc);
    if (ow_unpoisoned((uint8_t *)ri + filled * esz, cap - filled * esz, pz) >= 0)
      return ow_fail(msg, "%s: ids written past their %zu rows [%s]", what, filled / K, d->desc);
  }
  free(ri);
  ow_outs_free(&o);
  return rc;
}

START_TEST(received_ids_are_the_oracles_as_int64_and_int32) {
  ext_run(_i, 200 + (uint64_t)_i, wide_ids_rank);
}
END_TEST

/*
 * recv_count_per_expert_host: a dispatch that waits leaves there, as it
 * returns, the counts it wrote to recv_count_per_expert: the oracle's,
 * rounded to expert_alignment, in a buffer of their own or in
 * recv_count_per_expert itself, exactly num_experts / world_size of them
 * (the poison after them stays); a call refused for giving it with
 * num_worst_tokens leaves it as it was, on every rank alike (in step).
 */
static int host_counts_rank(struct ops_ctx *c, void *arg, char *msg) {
  const struct ext_case *e = arg;
  const struct ow_case *d = &e->d;
  const uint32_t r = c->rank, le = d->le;
  const struct ref_rank_in *in = &d->in[r];
  const struct ref_dispatch_out *want = &d->disp[r];
  struct ow_outs o;
  ow_outs_alloc(&o, d);
  int32_t dev[256 + 8], host[256 + 8], wc[256];
  ck_assert_uint_le(le, 256);
  int rc = 0;
  for (int round = 0; round < 3 && rc == 0; round++) {
    const uint8_t pz = round & 1 ? 0x5A : 0xA5;
    const uint32_t align = round == 2 ? 0 : e->align[r];
    int32_t *hc = round == 1 ? dev : host; /* round 1: the same memory as the device's */
    memset(dev, pz, sizeof dev);
    memset(host, pz, sizeof host);
    struct dep_dispatch_args a = {
        .size = sizeof a, .x = in->x, .topk_idx = d->idx[r], .index_type = d->sc.itype,
        .topk_weights = in->topk_weights, .num_tokens = in->num_tokens, .recv_x = o.rx,
        .recv_topk_idx = o.ridx, .recv_topk_weights = o.rw, .recv_count_per_expert = dev,
        .num_recv = &o.num_recv, .expert_alignment = align, .recv_count_per_expert_host = hc,
        .num_worst_tokens = o.rows_tp};
    if (host_ops_dispatch(c, &a, &o.h) != DEP_ERR_INVALID ||
        strstr(c->why, "recv_count_per_expert_host is not written with num_worst_tokens") == NULL)
      return ow_fail(msg, "recv_count_per_expert_host with num_worst_tokens was not refused "
                     "naming it (%s) [%s]", c->why, d->desc);
    if (ow_unpoisoned(host, sizeof host, pz) >= 0 || ow_unpoisoned(dev, sizeof dev, pz) >= 0)
      return ow_fail(msg, "the refused call wrote the counts [%s]", d->desc);
    a.num_worst_tokens = 0;
    EXT_CALL(host_ops_dispatch(c, &a, &o.h), "dispatch (recv_count_per_expert_host)");
    memcpy(wc, want->count, le * 4);
    ref_align_counts(wc, le, align);
    if (memcmp(hc, wc, le * 4) != 0 || memcmp(dev, wc, le * 4) != 0)
      return ow_fail(msg, "round %d: recv_count_per_expert_host %s recv_count_per_expert is not "
                     "the oracle's counts rounded to multiples of %u [%s]", round,
                     round == 1 ? "as" : "beside", align, d->desc);
    if (ow_unpoisoned(hc + le, 8 * 4, pz) >= 0 ||
        (round != 1 && ow_unpoisoned(dev + le, 8 * 4, pz) >= 0))
      return ow_fail(msg, "round %d: counts written past the %u local experts [%s]", round, le,
                     d->desc);
    if (o.num_recv != want->num_recv)
      return ow_fail(msg, "round %d: num_recv %u, want %u [%s]", round, o.num_recv,
                     want->num_recv, d->desc);
  }
  ow_outs_free(&o);
  return rc;
}

START_TEST(counts_on_the_host_are_the_oracles_as_the_call_returns) {
  ext_run(_i, 300 + (uint64_t)_i, host_counts_rank);
}
END_TEST

/* Rank 0 dispatches cached, rank 1 afresh: DEP_ERR_MISMATCH on both, then in step;
 * a num_worst_tokens below the rows received is DEP_ERR_INVALID, in step too. */
static int ext_fault_rank(struct ops_ctx *c, void *arg, char *msg) {
  const struct ow_case *d = arg;
  struct ow_outs o;
  ow_outs_alloc(&o, d);
  int rc = ow_dispatch(c, d, &o, &o.h);
  const struct ref_rank_in *in = &d->in[c->rank];
  if (rc == 0) {
    struct dep_dispatch_args cb = {.size = sizeof cb, .cached = 1, .x = in->x,
                                   .num_tokens = in->num_tokens, .recv_x = o.rx,
                                   .num_recv = &o.num_recv};
    rc = c->rank == 0 ? host_ops_dispatch(c, &cb, &o.h) : ow_dispatch(c, d, &o, &o.h);
    rc = rc == DEP_ERR_MISMATCH ? 0
                                : ow_fail(msg, "cached against fresh: %s (%s)", dep_errname(rc), c->why);
  }
  if (rc == 0 && (rc = ow_dispatch(c, d, &o, &o.h)) != 0)
    rc = ow_fail(msg, "after the mismatch: %s (%s)", dep_errname(rc), c->why);
  if (rc == 0) {
    const uint32_t n = d->disp[c->rank].num_recv;
    struct dep_dispatch_args a = {.size = sizeof a, .x = in->x, .topk_idx = d->idx[c->rank],
                                  .index_type = d->sc.itype, .topk_weights = in->topk_weights,
                                  .num_tokens = in->num_tokens, .recv_x = o.rx,
                                  .recv_topk_idx = o.ridx, .recv_topk_weights = o.rw,
                                  .recv_count_per_expert = o.cnt, .num_worst_tokens = n > 1 ? n - 1 : n};
    rc = host_ops_dispatch(c, &a, &o.h);
    if (n > 1 && (rc != DEP_ERR_INVALID || strstr(c->why, "num_worst_tokens") == NULL))
      rc = ow_fail(msg, "num_worst_tokens %u below %u rows: %s (%s)", n - 1, n, dep_errname(rc),
                   c->why);
    else
      rc = n > 1 ? 0 : rc;
  }
  uint64_t dig = 0;
  if (rc == 0)
    rc = ow_round_tp(c, d, &o, 0xA5, &dig, msg);
  ow_outs_free(&o);
  return rc;
}

START_TEST(cached_and_worst_case_faults_keep_the_ranks_in_step) {
  ow_run_small(ext_fault_rank, "cached/worst faults");
}
END_TEST

/* Ranks that disagree about a call's mode are told which modes met: a cached
 * dispatch against a fresh one, a weighted combine against a plain one (the
 * message named the moded call "unknown op"). */
static int mode_mismatch_rank(struct ops_ctx *c, void *arg, char *msg) {
  const struct ow_case *d = arg;
  const struct ref_rank_in *in = &d->in[c->rank];
  struct ow_outs o;
  ow_outs_alloc(&o, d);
  int rc = ow_dispatch(c, d, &o, &o.h);
  if (rc != 0)
    rc = ow_fail(msg, "dispatch: %s (%s)", dep_errname(rc), c->why);
  if (rc == 0) {
    struct dep_dispatch_args cb = {.size = sizeof cb, .cached = 1, .x = in->x,
                                   .num_tokens = in->num_tokens, .recv_x = o.rx,
                                   .num_recv = &o.num_recv};
    rc = c->rank == 0 ? host_ops_dispatch(c, &cb, &o.h) : ow_dispatch(c, d, &o, &o.h);
    const char *mine = c->rank == 0 ? "this rank ran dispatch (cached)" : "ran dispatch (cached)";
    rc = rc == DEP_ERR_MISMATCH && strstr(c->why, "unknown") == NULL && strstr(c->why, mine)
             ? 0
             : ow_fail(msg, "cached against fresh: %s (%s)", dep_errname(rc), c->why);
  }
  if (rc == 0 && (rc = ow_dispatch(c, d, &o, &o.h)) != 0)
    rc = ow_fail(msg, "dispatch after the mismatch: %s (%s)", dep_errname(rc), c->why);
  if (rc == 0) {
    float *ow = calloc((size_t)in->num_tokens * d->shape.topk + 1, sizeof *ow);
    struct dep_combine_args ca = {.size = sizeof ca, .x = o.rx, .out = o.out};
    if (c->rank == 0) {
      ca.topk_weights = o.rw;
      ca.out_topk_weights = ow;
    }
    rc = host_ops_combine(c, &ca, &o.h);
    const char *mine = c->rank == 0 ? "this rank ran combine (weighted)" : "ran combine (weighted)";
    rc = rc == DEP_ERR_MISMATCH && strstr(c->why, "unknown") == NULL && strstr(c->why, mine)
             ? 0
             : ow_fail(msg, "weighted against plain combine: %s (%s)", dep_errname(rc), c->why);
    free(ow);
  }
  ow_outs_free(&o);
  return rc;
}

START_TEST(a_mode_mismatch_names_both_modes) {
  ow_run_small(mode_mismatch_rank, "mode mismatch");
}
END_TEST

/* After a call timed out every later operation is DEP_ERR_STATE, as deepep(3)
 * says and the cuda backend does: a layout too, though it waits for no rank
 * (it ran on, as if the job could go on). */
START_TEST(a_layout_after_a_timed_out_call_is_state) {
  struct ow_rank0 *r = ow_rank0_open(&ow_small, 50);
  const struct ref_rank_in *in = &r->d.in[0];
  int rc = ow_dispatch(&r->c, &r->d, &r->o, &r->o.h); /* rank 1 never calls */
  ck_assert_msg(rc == DEP_ERR_TIMEOUT, "dispatch: %s (%s)", dep_errname(rc), r->c.why);
  struct dep_layout_args la = {.size = sizeof la, .topk_idx = r->d.idx[0],
                               .index_type = r->d.sc.itype, .num_tokens = in->num_tokens,
                               .tokens_per_rank = r->o.tpr, .tokens_per_expert = r->o.tpe,
                               .token_in_rank = r->o.tir};
  rc = host_ops_layout(&r->c, &la);
  ck_assert_msg(rc == DEP_ERR_STATE && strstr(r->c.why, "out of step") != NULL,
                "layout after the timeout: %s (%s)", dep_errname(rc), r->c.why);
  ow_rank0_close(r);
}
END_TEST

/* ---- combine's biases (deepep.h dep_combine_args bias_0, bias_1) ------------------ */

/* A bf16 in [-4, 4): a bias of the size of the vectors it is added to. */
static uint16_t bias_value(void) {
  return host_ops_float_to_bf16(ldexpf(ow_unif() * 2.0f - 1.0f, 2));
}

/*
 * Per round a dispatch and a combine with biases, each result bit for bit
 * the oracle's single rounding (ow_want_combine): both biases; bias_1 alone
 * in a weighted combine; bias_0 alone after a cached dispatch; none.
 */
static int bias_rank(struct ops_ctx *c, void *arg, char *msg) {
  const struct ext_case *e = arg;
  const struct ow_case *d = &e->d;
  const uint32_t r = c->rank, h = d->sc.hidden, K = d->sc.topk, mt = d->sc.max_tokens;
  const struct ref_rank_in *in = &d->in[r];
  const size_t cells = (size_t)in->num_tokens * h;
  struct ow_outs o;
  ow_outs_alloc(&o, d);
  uint16_t *b0 = malloc(cells * 2 + 2), *b1 = malloc(cells * 2 + 2);
  uint16_t *want = malloc(cells * 2 + 2);
  float *acc = malloc(h * 4), *ow = malloc(((size_t)mt * K + 1) * 4);
  ck_assert(b0 && b1 && want && acc && ow);
  for (size_t i = 0; i < cells; i++)
    b0[i] = bias_value(), b1[i] = bias_value();
  int rc = 0;
  for (int round = 0; round < 4 && rc == 0; round++) {
    const uint8_t pz = round & 1 ? 0x5A : 0xA5;
    const uint16_t *g0 = round == 0 || round == 2 ? b0 : NULL;
    const uint16_t *g1 = round <= 1 ? b1 : NULL;
    EXT_CALL(ow_dispatch(c, d, &o, &o.h), "dispatch");
    if (round == 2) {
      struct dep_dispatch_args cb = {.size = sizeof cb, .cached = 1, .x = in->x,
                                     .num_tokens = in->num_tokens, .recv_x = o.rx,
                                     .num_recv = &o.num_recv};
      EXT_CALL(host_ops_dispatch(c, &cb, &o.h), "dispatch (cached)");
    }
    memset(o.out, pz, (size_t)mt * h * 2);
    struct dep_combine_args ca = {.size = sizeof ca, .x = d->cx[r], .out = o.out,
                                  .bias_0 = g0, .bias_1 = g1};
    if (round == 1)
      ca.topk_weights = e->cw[r], ca.out_topk_weights = ow;
    EXT_CALL(host_ops_combine(c, &ca, &o.h), "combine (bias)");
    ow_want_combine(d, r, g0, g1, want, acc);
    for (size_t i = 0; i < cells; i++)
      if (o.out[i] != want[i]) {
        rc = ow_fail(msg, "combine (bias_0 %s, bias_1 %s%s): token %zu channel %zu is 0x%04x, "
                     "want 0x%04x, the float32 sum rounded once [%s]", g0 ? "given" : "NULL",
                     g1 ? "given" : "NULL", round == 2 ? ", cached" : round == 1 ? ", weighted" : "",
                     i / h, i % h, o.out[i], want[i], d->desc);
        break;
      }
    if (rc == 0 && ow_unpoisoned(o.out + cells, (size_t)mt * h * 2 - cells * 2, pz) >= 0)
      rc = ow_fail(msg, "combine (bias): written past num_tokens [%s]", d->desc);
  }
  free(b0), free(b1), free(want), free(acc), free(ow);
  ow_outs_free(&o);
  return rc;
}

START_TEST(combine_with_biases_rounds_once_as_the_oracle) {
  ext_run(_i, 400 + (uint64_t)_i, bias_rank);
}
END_TEST

/*
 * A case built so that adding the biases after the combine's rounding (what
 * deep_ep did before 0.6.0) gives another bf16 than DeepEP's one rounding:
 * one token, on both of two ranks, whose vectors are 1 (rank 0) and 2^-8
 * (rank 1), biases 2^-9 each.  DeepEP's order: 2^-9 + 2^-9 + 1 + 2^-8 =
 * 1 + 2^-7, a bf16 (0x3f81).  Rounded first: bf16(1 + 2^-8) is a tie, to
 * even 1 (0x3f80), and bf16(1 + 2^-9 + 2^-9) is the same tie, 1 again.
 */
#define TIE_ONE 0x3f80u        /* bf16 1.0 */
#define TIE_ULP_HALF 0x3b80u   /* bf16 2^-8: half of 1.0's ulp */
#define TIE_BIAS 0x3b00u       /* bf16 2^-9 */
#define TIE_ONE_ULP 0x3f81u    /* bf16 1 + 2^-7 */

/* One token of x, routed to experts 0 and 1 (ranks 0 and 1 of a world of 2) with weights 1,
 * dispatched: its two rows into rx, the call's handle into hd.  0, or ow_fail's. */
static int dispatch_one_to_both(struct ops_ctx *c, const uint16_t *x, uint16_t *rx,
                                struct dep_handle *hd, char *msg) {
  static const int64_t idx[2] = {0, 1};
  static const float w[2] = {1.0f, 1.0f};
  int32_t ridx[4], cnt[1];
  float rw[4];
  uint32_t nr = 0;
  host_ops_handle_init(hd);
  struct dep_dispatch_args da = {.size = sizeof da, .x = x, .topk_idx = idx,
                                 .index_type = DEP_INDEX_I64, .topk_weights = w, .num_tokens = 1,
                                 .recv_x = rx, .recv_topk_idx = ridx, .recv_topk_weights = rw,
                                 .recv_count_per_expert = cnt, .num_recv = &nr};
  int rc = host_ops_dispatch(c, &da, hd);
  if (rc != 0 || nr != 2)
    return ow_fail(msg, "dispatch: %s, %u rows (want 2): %s", dep_errname(rc), nr, c->why);
  return 0;
}

static int tie_rank(struct ops_ctx *c, void *arg, char *msg) {
  (void)arg;
  enum { H = 128 };
  const uint32_t r = c->rank;
  static uint16_t x[H], cx[2 * H], out[H], bias[H];
  uint16_t rx[2 * H];
  struct dep_handle hd;
  for (int i = 0; i < H; i++)
    x[i] = (uint16_t)TIE_ONE, bias[i] = (uint16_t)TIE_BIAS;
  int rc = dispatch_one_to_both(c, x, rx, &hd, msg);
  if (rc != 0)
    return rc;
  for (int i = 0; i < 2 * H; i++) /* each row this rank sends back: 1 from rank 0, 2^-8 from 1 */
    cx[i] = (uint16_t)(r == 0 ? TIE_ONE : TIE_ULP_HALF);
  struct dep_combine_args ca = {.size = sizeof ca, .x = cx, .out = out};
  if ((rc = host_ops_combine(c, &ca, &hd)) != 0)
    return ow_fail(msg, "combine: %s: %s", dep_errname(rc), c->why);
  /* Adding the biases to this rounded sum is the old way: it must land on the tie's even. */
  const float late = host_ops_bf16_to_float(out[0]) + host_ops_bf16_to_float(TIE_BIAS) +
                     host_ops_bf16_to_float(TIE_BIAS);
  if (out[0] != TIE_ONE || host_ops_float_to_bf16(late) != TIE_ONE)
    return ow_fail(msg, "the built case does not part the two roundings: combine gave 0x%04x, "
                   "bias added after it 0x%04x (want 0x%04x both)", out[0],
                   host_ops_float_to_bf16(late), TIE_ONE);
  ca.bias_0 = bias, ca.bias_1 = bias;
  if ((rc = host_ops_combine(c, &ca, &hd)) != 0)
    return ow_fail(msg, "combine (bias): %s: %s", dep_errname(rc), c->why);
  for (int i = 0; i < H; i++)
    if (out[i] != TIE_ONE_ULP)
      return ow_fail(msg, "combine (bias): channel %d is 0x%04x, want 0x%04x (1 + 2^-7: the "
                     "biases added before the one rounding, as DeepEP's kernel does; 0x%04x is "
                     "the bias added after rounding)", i, out[i], TIE_ONE_ULP, TIE_ONE);
  host_ops_handle_fini(&hd);
  return 0;
}

START_TEST(biases_are_added_before_the_one_rounding) {
  const struct dep_job_shape s = {1, 128, 2, 2, DEP_DTYPE_BF16, 1};
  ow_run_ranks(&s, 2, tie_rank, NULL, "bias before rounding");
}
END_TEST

/*
 * The combine's sum at the edges of float32 and bf16, bit for bit the
 * one-channel sum (ow_want_combine's formula): every pair of the codes
 * below, one from each of two ranks, in one token's channels: signed
 * zeros (-0 + -0 is +0, the sum starting from +0), infinities and their
 * difference, the largest finite values overflowing, subnormals, ties to
 * even each way, a quiet and a signalling NaN; then the same with a bias.
 * A sum that is NaN must be a NaN (which payload, when both terms are
 * NaNs, is the hardware's operand order, which deepep.h does not promise).
 */
static const uint16_t edge_codes[16] = {
    0x0000, 0x8000, 0x7f80, 0xff80, 0x7fc0, 0x7f81, 0x7f7f, 0xff7f,
    0x0001, 0x8001, 0x3f80, 0x3b80, 0xbf80, 0x3b00, 0x4000, 0x3f81};
enum { EDGE_H = 256 }; /* every pair: 16 x 16 channels */

static int edge_rank(struct ops_ctx *c, void *arg, char *msg) {
  (void)arg;
  const uint32_t r = c->rank;
  static uint16_t x[EDGE_H], cx[2 * EDGE_H], out[EDGE_H], bias[EDGE_H], rx[2 * EDGE_H];
  struct dep_handle hd;
  for (int i = 0; i < EDGE_H; i++)
    x[i] = 0x3f80, bias[i] = edge_codes[(i * 5 + 3) % 16];
  int rc = dispatch_one_to_both(c, x, rx, &hd, msg);
  if (rc != 0)
    return rc;
  /* Rank 0 sends back the code of a channel's low four bits, rank 1 of its high four. */
  for (int i = 0; i < 2 * EDGE_H; i++)
    cx[i] = edge_codes[r == 0 ? i % 16 : i % EDGE_H / 16];
  for (int with_bias = 0; with_bias < 2; with_bias++) {
    struct dep_combine_args ca = {.size = sizeof ca, .x = cx, .out = out,
                                  .bias_0 = with_bias ? bias : NULL};
    if ((rc = host_ops_combine(c, &ca, &hd)) != 0)
      return ow_fail(msg, "combine: %s: %s", dep_errname(rc), c->why);
    for (int i = 0; i < EDGE_H; i++) {
      const uint16_t a = edge_codes[i % 16], b = edge_codes[i / 16];
      const float want_f = (with_bias ? host_ops_bf16_to_float(bias[i]) + 0.0f : 0.0f) +
                           host_ops_bf16_to_float(a) + host_ops_bf16_to_float(b);
      const uint16_t want = host_ops_float_to_bf16(want_f);
      const bool nan = (want & 0x7fffu) > 0x7f80u, got_nan = (out[i] & 0x7fffu) > 0x7f80u;
      if (nan ? !got_nan : out[i] != want)
        return ow_fail(msg, "combine%s: channel %d: 0x%04x + 0x%04x%s gave 0x%04x, want 0x%04x",
                       with_bias ? " (bias_0)" : "", i, a, b, with_bias ? " + bias" : "",
                       out[i], want);
    }
  }
  host_ops_handle_fini(&hd);
  return 0;
}

START_TEST(a_combines_sum_keeps_every_bit_at_the_edges) {
  const struct dep_job_shape s = {1, EDGE_H, 2, 2, DEP_DTYPE_BF16, 1};
  ow_run_ranks(&s, 2, edge_rank, NULL, "combine at the edges");
}
END_TEST

/* The new arguments' refusals: DEP_ERR_INVALID naming each, nothing written. */
START_TEST(bad_extension_arguments_are_refused_before_any_write) {
  struct ow_rank0 *r = ow_rank0_open(&ow_small, 200);
  struct ops_ctx *c = &r->c;
  struct ow_case *d = &r->d;
  struct ow_outs *o = &r->o;
  const struct ref_rank_in *in = &d->in[0];
  float sc[64] = {1.0f}, ow[64];
  const struct dep_dispatch_args da = {
      .size = sizeof da, .x = in->x, .topk_idx = d->idx[0], .index_type = DEP_INDEX_I64,
      .topk_weights = in->topk_weights, .num_tokens = 4, .recv_x = o->rx, .recv_topk_idx = o->ridx,
      .recv_topk_weights = o->rw, .recv_count_per_expert = o->cnt, .num_recv = &o->num_recv};
  struct dep_dispatch_args b;
#define BAD(...) (b = da, __VA_ARGS__, host_ops_dispatch(c, &b, &o->h))
  OW_REFUSED(BAD(b.use_fp8 = 2), "use_fp8");
  OW_REFUSED(BAD(b.use_fp8 = 1, b.recv_x_scales = sc), "x_scales (required with use_fp8) is NULL");
  OW_REFUSED(BAD(b.use_fp8 = 1, b.x_scales = sc), "recv_x_scales (required");
  OW_REFUSED(BAD(b.x_scales = sc), "x_scales is not read without use_fp8");
  OW_REFUSED(BAD(b.recv_x_scales = sc), "recv_x_scales is not read without use_fp8");
  OW_REFUSED(BAD(b.num_worst_tokens = 9), "num_worst_tokens 9 exceeds the 8 rows");
  OW_REFUSED(BAD(b.expert_alignment = 65537), "expert_alignment 65537");
  OW_REFUSED(BAD(b.cached = 2), "cached is 2");
  OW_REFUSED(BAD(b.cached = 1), "holds no dispatch");
  OW_REFUSED(BAD(b.recv_index_type = 3), "recv_index_type 3 is neither 0 nor DEP_INDEX_I32");
  OW_REFUSED(BAD(b.recv_index_type = DEP_INDEX_I64, b.recv_topk_idx = o->ridx + 1),
          "recv_topk_idx is not 8-byte aligned");
  int32_t hc[8];
  OW_REFUSED(BAD(b.recv_count_per_expert_host = hc, b.num_worst_tokens = 8),
             "recv_count_per_expert_host is not written with num_worst_tokens");
  OW_REFUSED(BAD(b.recv_count_per_expert_host = (int32_t *)((uintptr_t)hc + 2)),
             "recv_count_per_expert_host is not 4-byte aligned");
#undef BAD
  /* A handle with a dispatch in it, made without writing to the slabs: its fields by hand. */
  struct dep_handle h = o->h;
  h.kind = OPS_HANDLE_TP, h.world = 2, h.rank = 0, h.hidden = d->shape.hidden;
  h.topk = d->shape.topk, h.num_experts = d->shape.num_experts;
  h.max_tokens = d->shape.max_tokens_per_rank, h.max_ll_tokens = c->lay.max_ll_tokens;
  h.num_tokens = 4, h.num_recv = 5;
  const struct dep_dispatch_args ca = {.size = sizeof ca, .cached = 1, .x = in->x,
                                       .num_tokens = 4, .recv_x = o->rx, .num_recv = &o->num_recv};
#define BAD(...) (b = ca, __VA_ARGS__, host_ops_dispatch(c, &b, &h))
  OW_REFUSED(BAD(b.topk_idx = d->idx[0]), "topk_idx is not read in cached mode");
  OW_REFUSED(BAD(b.topk_weights = in->topk_weights), "topk_weights is not read in cached mode");
  OW_REFUSED(BAD(b.recv_topk_idx = o->ridx), "recv_topk_idx is not read in cached mode");
  OW_REFUSED(BAD(b.recv_index_type = -1), "recv_index_type -1");
  OW_REFUSED(BAD(b.recv_count_per_expert = o->cnt), "recv_count_per_expert is not read");
  OW_REFUSED(BAD(b.recv_count_per_expert_host = hc),
             "recv_count_per_expert_host is not read in cached mode");
  OW_REFUSED(BAD(b.expert_alignment = 2), "expert_alignment is not used in cached mode");
  OW_REFUSED(BAD(b.num_tokens = 3), "num_tokens 3, but the handle's dispatch had 4");
  OW_REFUSED(BAD(b.num_worst_tokens = 4), "num_worst_tokens 4 is below the 5 rows");
  h.worst = 6;
  OW_REFUSED(BAD((void)0), "give num_worst_tokens here too");
#undef BAD
  h.worst = 0;
  struct dep_combine_args cw = {.size = sizeof cw, .x = d->cx[0], .out = o->out,
                                .out_topk_weights = ow};
  OW_REFUSED(host_ops_combine(c, &cw, &h), "topk_weights (required with out_topk_weights) is NULL");
  cw.out_topk_weights = NULL, cw.topk_weights = sc;
  OW_REFUSED(host_ops_combine(c, &cw, &h), "topk_weights is given without out_topk_weights");
  cw.topk_weights = NULL;
  const uint16_t *odd = (const uint16_t *)((uintptr_t)o->out + 1);
  cw.bias_0 = odd;
  OW_REFUSED(host_ops_combine(c, &cw, &h), "bias_0 is not 2-byte aligned");
  cw.bias_0 = NULL, cw.bias_1 = odd;
  OW_REFUSED(host_ops_combine(c, &cw, &h), "bias_1 is not 2-byte aligned");
  /* With no tokens the biases are not read, so neither is checked. */
  h.num_tokens = 0, cw.bias_0 = odd;
  char why[256] = "";
  ck_assert_msg(ops_check_combine(c, &cw, &h, why, sizeof why) == 0, "no tokens: %s", why);
  ow_rank0_close(r);
}
END_TEST

Suite *ops_ext_suite(void);
Suite *ops_ext_suite(void) {
  Suite *s = suite_create("ops_ext");
  TCase *ops = tcase_create("oracle");
  tcase_set_timeout(ops, 60);
  tcase_add_loop_test(ops, throughput_extensions_match_the_oracle, 0,
                      (int)(sizeof ext_scenarios / sizeof ext_scenarios[0]));
  tcase_add_loop_test(ops, received_ids_are_the_oracles_as_int64_and_int32, 0,
                      (int)(sizeof ext_scenarios / sizeof ext_scenarios[0]));
  tcase_add_loop_test(ops, counts_on_the_host_are_the_oracles_as_the_call_returns, 0,
                      (int)(sizeof ext_scenarios / sizeof ext_scenarios[0]));
  tcase_add_loop_test(ops, combine_with_biases_rounds_once_as_the_oracle, 0,
                      (int)(sizeof ext_scenarios / sizeof ext_scenarios[0]));
  tcase_add_test(ops, biases_are_added_before_the_one_rounding);
  tcase_add_test(ops, a_combines_sum_keeps_every_bit_at_the_edges);
  suite_add_tcase(s, ops);

  TCase *faults = tcase_create("faults");
  tcase_set_timeout(faults, 30);
  tcase_add_test(faults, cached_and_worst_case_faults_keep_the_ranks_in_step);
  tcase_add_test(faults, a_mode_mismatch_names_both_modes);
  tcase_add_test(faults, a_layout_after_a_timed_out_call_is_state);
  tcase_add_test(faults, bad_extension_arguments_are_refused_before_any_write);
  suite_add_tcase(s, faults);
  return s;
}
