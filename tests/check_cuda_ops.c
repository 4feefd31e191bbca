/*
 * check_cuda_ops.c — the cuda backend's kernels as a specification (DESIGN
 * §6): ranks attach to a real deepepd on the cuda backend, as separate
 * processes and as threads (streams) of one process, and every
 * output of layout, dispatch, combine and the low-latency forms (bf16 and
 * FP8) is held against the reference oracle (tests/ref.c): moves bit for
 * bit, sums bit for bit against the host backend's float32 order (and within
 * the oracle's bound).  Outputs are poisoned before every call, so an
 * unwritten element or a write past the valid count fails.  Also: 240
 * calls back to back, every op through a handle in memory the caller
 * lends (dep_handle_new_in), (case budget) every op on a budget below
 * the world, each CTA sending to several ranks in turn, and (case crowd)
 * more ranks on one GPU than it could hold a CTA of each to each.  The suite's faults case (a rank that never
 * calls, a rank gone, bad ids and arguments) is check_cuda_ops_faults.c's,
 * its masks case (masked ranks skipped) check_cuda_ops_mask.c's, its split
 * case (low-latency calls split into send and receive) check_cuda_ops_split.c's.
 *
 * Tagged "gpu": each test skips, saying why, unless DEP_TEST_BACKEND=cuda
 * and a GPU is present (make check-gpu).  The test process never touches
 * CUDA before it forks its rank processes; each rank finds its GPU's UUID
 * through the driver itself.  Inputs are random from a printed seed
 * (DEP_TEST_SEED replays).
 *
 * DEP_TEST_GPUS spreads the ranks (processes or threads) over GPUs: rank r
 * on GPU r % N, N = DEP_TEST_GPUS or every visible GPU for "all"; unset,
 * all on GPU 0.  Asking for more GPUs than are visible fails each test.
 */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cudadrv.h"
#include "deepep.h"
#include "host_ops.h"
#include "opsworld.h"
#include "ref.h"
#include "sm_budget.h"
#include "cudaranks.h"
#include "check_cuda_ops.h"
#include "cudarounds.h"
#include "testutil.h"

/* ---- every op against the oracle ------------------------------------------------------- */

static const struct ow_scenario scenarios[] = {
  /* world hidden topk experts max_tokens max_ll  routing  tokens  index  fp8 */
  {1, 128, 1, 4, 8, 8, P_RANDOM, T_MAX, DEP_INDEX_I64, 0},
  {1, 7168, 8, 32, 64, 32, P_RANDOM, T_MAX, DEP_INDEX_I32, 1},
  {2, 2048, 2, 8, 128, 64, P_RANDOM, T_MIXED, DEP_INDEX_I32, 1},
  {2, 128, 8, 8, 16, 16, P_RANDOM, T_ZERO, DEP_INDEX_I64, 0},
  {2, 2048, 1, 4, 300, 300, P_RANDOM, T_MAX, DEP_INDEX_I64, 1}, /* scans span several chunks */
  {3, 128, 4, 6, 24, 0, P_RANDOM, T_MAX, DEP_INDEX_I32, 1},     /* max_ll 0: the default */
  {4, 128, 16, 16, 32, 32, P_RANDOM, T_MAX, DEP_INDEX_I32, 1},
  {4, 7168, 2, 8, 16, 8, P_RANDOM, T_ONE, DEP_INDEX_I64, 0},
  {4, 2048, 8, 32, 64, 64, P_ONE_RANK, T_MAX, DEP_INDEX_I64, 1},
  {4, 128, 8, 16, 16, 16, P_NONE, T_MAX, DEP_INDEX_I32, 0},
  {4, 128, 1, 4, 512, 256, P_ONE_EXPERT, T_MAX, DEP_INDEX_I64, 0},
  {8, 128, 8, 64, 16, 16, P_RANDOM, T_MIXED, DEP_INDEX_I64, 1},
  {8, 7168, 8, 16, 32, 16, P_RANDOM, T_MAX, DEP_INDEX_I32, 1},
  {8, 2048, 16, 128, 32, 16, P_DUP, T_MAX, DEP_INDEX_I64, 0},
  {8, 128, 2, 8, 16, 16, P_RANDOM, T_ZERO, DEP_INDEX_I32, 1},
  {8, 128, 8, 256, 64, 64, P_RANDOM, T_MAX, DEP_INDEX_I32, 1},  /* 32 experts a rank */
  {8, 2048, 8, 64, 64, 32, P_RANDOM, T_ONE, DEP_INDEX_I64, 0},
  /* DeepEP's test_low_latency.py's defaults: 36 experts a rank, 128 low-latency tokens */
  {8, 7168, 8, 288, 128, 128, P_RANDOM, T_MAX, DEP_INDEX_I64, 1},
};

static void run_scenario(const struct ow_scenario *sc, int salt, bool threads) {
  ow_seed_init((uint64_t)salt);
  struct ow_case *d = malloc(sizeof *d);
  ck_assert_ptr_nonnull(d);
  ow_case_make(d, sc, sc->fp8);
  /* The test daemon's pool (1 GiB) holds the small shapes; one of DeepEP's own (hidden 7168,
   * 128 tokens, 8 ranks) needs its slabs' bytes, rounded up to whole GiB, in larger chunks
   * (fewer fds per attach). */
  struct dep_slab_layout l;
  char why[256] = "", yaml[160];
  ck_assert_msg(dep__slab_layout(&d->shape, sc->world, &l, why, sizeof why) == 0, "%s", why);
  const uint64_t gib = (l.total_bytes * sc->world + (1ull << 30) - 1) >> 30;
  snprintf(yaml, sizeof yaml, "pool:\n  host_size: %s\n  chunk_size: %s\n"
           "  size_per_device: %lluGiB\n", gib > 1 ? "256MiB" : "64MiB",
           gib > 1 ? "256MiB" : "2MiB", (unsigned long long)(gib > 1 ? gib + 1 : 1));
  struct cr_world w;
  cr_world_start(&w, yaml);
  struct cr_rounds a = {d, 1, 2};
  char job[32];
  snprintf(job, sizeof job, "%s-%d", threads ? "threads" : "procs", salt);
  uint64_t t0 = cr_ms_now();
  if (threads)
    cr_run_threads(&w, job, &d->shape, sc->world, cr_body_rounds, &a, d->desc);
  else
    cr_run_procs(&w, job, &d->shape, sc->world, cr_body_rounds, &a, d->desc);
  printf("cuda_ops %s: %s: ok in %llu ms\n", threads ? "threads" : "processes", d->desc,
         (unsigned long long)(cr_ms_now() - t0));
  cr_world_stop(&w);
  ow_case_free(d);
  free(d);
}

/* Ranks as processes (on one GPU, or spread by DEP_TEST_GPUS): every output as the oracle
 * says, twice, bit-identical. */
START_TEST(ranks_as_processes_match_the_oracle) {
  CR_NEEDS_GPU();
  run_scenario(&scenarios[_i], _i, false);
}
END_TEST

/*
 * 24 rank processes on one GPU under MPS (DeepEP's test_internode.py on one
 * GPU runs 16): each rank's budget is 132 / 24 = 5 CTAs on an H100 or
 * H200, and its kernels launch that many (kabi.h "SM budget"), 120 in all,
 * every one resident at once.  On the old code each kernel was 24 CTAs, one
 * a destination whatever the budget: 576 of the 264 such a GPU holds at
 * once (two an SM), so a rank's dispatch waited at its grid barrier for
 * CTAs that could not start until the op timeout.  Every op as the oracle
 * says.  Needs MPS: without it the 24 contexts take turns on the GPU.
 */
START_TEST(ranks_crowding_one_gpu_stay_within_their_budgets_and_match_the_oracle) {
  struct tu_gpus g;
  if (!cr_gpu_probe(__func__, &g))
    return;
  if (!g.mps) {
    tu_skip(__func__, "24 ranks on one GPU need MPS (without it their contexts take turns); "
            "run this test under MPS");
    return;
  }
  /* All on GPU 0 whatever DEP_TEST_GPUS says (this test runs in a process of its own). */
  setenv("DEP_TEST_GPUS", "1", 1);
  static const struct ow_scenario sc = {24, 128, 2, 24, 16, 16, P_RANDOM, T_MAX, DEP_INDEX_I32, 0};
  run_scenario(&sc, 700, false);
}
END_TEST

static const struct ow_scenario thread_scenarios[] = {
  {4, 2048, 8, 32, 64, 64, P_RANDOM, T_MIXED, DEP_INDEX_I64, 1},
  {8, 128, 2, 16, 32, 32, P_RANDOM, T_MAX, DEP_INDEX_I32, 1},
  {2, 7168, 8, 16, 16, 16, P_DUP, T_MAX, DEP_INDEX_I32, 0},
};

/*
 * Ranks as threads need a hardware queue per stream (cuda_ops.h), and an MPS
 * client gets too few: measured on an H200, CUDA_DEVICE_MAX_CONNECTIONS=32
 * under MPS fails context creation ("hardware resources required to support
 * device connections have been exhausted"), and the default 8 shared among
 * 4-8 rank streams let one rank's kernel wait behind another's.  So these
 * run outside MPS (as make check-gpu's time-sliced case does) and skip,
 * saying so, under it.
 */
static bool threads_ready(const char *test) {
  struct tu_gpus g;
  if (!cr_gpu_probe(test, &g))
    return false;
  if (g.mps) {
    tu_skip(test, "MPS is running; ranks as threads of one process need a hardware queue per "
            "stream, which MPS clients do not get; run this test without MPS");
    return false;
  }
  return true;
}

/* Ranks as threads of one process, each its own client and stream: the same. */
START_TEST(ranks_as_threads_of_one_process_match_the_oracle) {
  if (!threads_ready(__func__))
    return;
  run_scenario(&thread_scenarios[_i], 100 + _i, true);
}
END_TEST

/* Without MPS the rank processes time-slice the GPU: slower, never stuck. */
START_TEST(time_sliced_ranks_make_progress) {
  CR_NEEDS_GPU();
  /* Both ranks on one GPU whatever DEP_TEST_GPUS says, or nothing is time-sliced
   * (this test runs in a process of its own, with its ranks its children). */
  setenv("DEP_TEST_GPUS", "1", 1);
  static const struct ow_scenario sc = {2, 128, 2, 8, 16, 16, P_RANDOM, T_MAX, DEP_INDEX_I32, 1};
  run_scenario(&sc, 200, false);
}
END_TEST

/* 60 rounds of dispatch, combine, LL dispatch, LL combine (240 calls), inputs
 * changing every round, FP8 in alternate sets, every output checked. */
START_TEST(two_hundred_forty_calls_back_to_back_stay_correct) {
  CR_NEEDS_GPU();
  enum { NSETS = 5 };
  ow_seed_init(300);
  struct ow_scenario sc = {4, 2048, 8, 32, 64, 64, P_RANDOM, T_MIXED, DEP_INDEX_I32, 0};
  struct ow_case *cases = malloc(NSETS * sizeof *cases);
  ck_assert_ptr_nonnull(cases);
  static const int patterns[NSETS] = {P_RANDOM, P_DUP, P_ONE_RANK, P_RANDOM, P_ONE_EXPERT};
  for (int i = 0; i < NSETS; i++) {
    sc.itype = i & 1 ? DEP_INDEX_I64 : DEP_INDEX_I32;
    sc.pattern = patterns[i];
    sc.tokens = i == 3 ? T_MAX : T_MIXED;
    ow_case_make(&cases[i], &sc, i & 1);
  }
  struct cr_world w;
  cr_world_start(&w, NULL);
  struct cr_rounds a = {cases, NSETS, 60};
  uint64_t t0 = cr_ms_now();
  cr_run_procs(&w, "back-to-back", &cases[0].shape, sc.world, cr_body_rounds, &a, "240 calls");
  printf("cuda_ops: 240 calls back to back (with checks) in %llu ms\n",
         (unsigned long long)(cr_ms_now() - t0));
  cr_world_stop(&w);
  for (int i = 0; i < NSETS; i++)
    ow_case_free(&cases[i]);
  free(cases);
}
END_TEST

/* ---- throughput extensions: FP8, num_worst_tokens, alignment, cached, weights ---------- */

void ext_gpu_make(struct ext_gpu *e, const struct ow_scenario *sc) {
  memset(e, 0, sizeof *e);
  ow_case_make(&e->d, sc, 0);
  const uint32_t h = sc->hidden;
  struct ref_rank_in in8[OW_MAXW];
  for (uint32_t r = 0; r < sc->world; r++) {
    const uint32_t n = e->d.in[r].num_tokens;
    e->x8[r] = malloc((size_t)n * h + 1);
    e->scales[r] = malloc(((size_t)n * (h / 128) + 1) * 4);
    ck_assert(e->x8[r] && e->scales[r]);
    for (size_t i = 0; i < (size_t)n * h; i++)
      e->x8[r][i] = (uint8_t)ow_rnd();
    for (size_t i = 0; i < (size_t)n * (h / 128); i++)
      e->scales[r][i] = ow_unif() + 1e-3f;
    in8[r] = e->d.in[r];
    in8[r].x8 = e->x8[r];
    in8[r].scales = e->scales[r];
    e->align[r] = 1u + ow_below(8) * (r + 1);
  }
  ck_assert_int_eq(ref_dispatch(&e->d.shape, sc->world, in8, e->disp8), 0);
}

void ext_gpu_free(struct ext_gpu *e) {
  for (uint32_t r = 0; r < e->d.sc.world; r++)
    free(e->x8[r]), free(e->scales[r]);
  ref_dispatch_free(e->disp8, e->d.sc.world);
  ow_case_free(&e->d);
}

/*
 * Per round: an FP8 dispatch with expert_alignment (even rounds with
 * num_worst_tokens = the capacity, so no synchronisation, odd ones without),
 * a cached bf16 dispatch through its handle, and a weighted combine of
 * recv_topk_weights: rows, scales, ids, padding, counts, the combined
 * vectors and weights as the host backend's float32 order gives them.
 * Buffers reused: FP8 x and its scales in B_X, the FP8 rows and their
 * scales in B_RX, out_topk_weights in B_LRX.
 */
int ext_gpu_body(struct rk *k, void *arg) {
  const struct ext_gpu *e = arg;
  const struct ow_case *d = &e->d;
  const uint32_t r = k->rank, h = k->h_, K = k->K, G = h / 128, n = d->in[r].num_tokens;
  const size_t rows = k->sz[B_RX] / (h * 2);
  const struct ref_dispatch_out *w8 = &e->disp8[r], *wb = &d->disp[r];
  const uint32_t nr = wb->num_recv;
  if (k->sz[B_LRX] < (size_t)k->mt * K * 4 + 4)
    return ow_fail(k->msg, "test set-up: B_LRX too small for out_topk_weights [%s]", d->desc);
  if (cr_put(k, B_IDX, d->idx[r], (size_t)n * K * (d->sc.itype == DEP_INDEX_I64 ? 8 : 4)) ||
      cr_put(k, B_W, d->in[r].topk_weights, (size_t)n * K * 4) ||
      cr_put(k, B_CX, d->cx[r], (size_t)nr * h * 2))
    return 1;
  uint8_t *xs = (uint8_t *)CR_DEV(k, B_X), *rxs = (uint8_t *)CR_DEV(k, B_RX);
  const size_t sc_off = (size_t)k->mt * h; /* after the largest batch's FP8 bytes */
  for (int round = 0; round < 4; round++) {
    const uint8_t pz = round & 1 ? 0x5A : 0xA5;
    const uint32_t worst = round % 2 == 0 ? (uint32_t)rows : 0;
    if (cr_put(k, B_X, e->x8[r], (size_t)n * h) ||
        cr_put_at(k, (CUdeviceptr)(uintptr_t)(xs + sc_off), e->scales[r], (size_t)n * G * 4) ||
        cr_poison(k, B_RX, pz) || cr_poison(k, B_RIDX, pz) || cr_poison(k, B_RW, pz) ||
        cr_poison(k, B_CNT, pz))
      return ow_fail(k->msg, "round %d: uploading the FP8 inputs failed", round);
    uint32_t nrecv = 0xdeadbeef;
    int32_t host_cnt[256 + 8];
    memset(host_cnt, pz, sizeof host_cnt);
    struct dep_dispatch_args a = {
        .size = sizeof a, .use_fp8 = 1, .x = xs, .x_scales = (const float *)(xs + sc_off),
        .topk_idx = CR_DEV(k, B_IDX), .index_type = d->sc.itype, .topk_weights = CR_DEV(k, B_W),
        .num_tokens = n, .recv_x = rxs, .recv_x_scales = (float *)(rxs + rows * h),
        .recv_topk_idx = CR_DEV(k, B_RIDX), .recv_topk_weights = CR_DEV(k, B_RW),
        .recv_count_per_expert = CR_DEV(k, B_CNT), .num_recv = worst ? NULL : &nrecv,
        .num_worst_tokens = worst, .expert_alignment = e->align[r],
        .recv_count_per_expert_host = worst ? NULL : host_cnt};
    CALL(k, dep_dispatch(k->c, &a, k->h, k->s), "dep_dispatch (fp8)");
    if (!worst && nrecv != nr)
      return ow_fail(k->msg, "dispatch (fp8): num_recv %u, want %u [%s]", nrecv, nr, d->desc);
    if (cr_get(k, B_RX))
      return 1;
    for (uint32_t i = 0; i < nr; i++)
      if (memcmp(k->host + (size_t)i * h, w8->x8 + (size_t)i * h, h) != 0 ||
          memcmp(k->host + rows * h + (size_t)i * G * 4, w8->scales + (size_t)i * G, G * 4) != 0)
        return ow_fail(k->msg, "dispatch (fp8): row %u (rank %u token %u): bytes or scales "
                       "differ [%s]", i, w8->from[i].rank, w8->from[i].token, d->desc);
    if (ow_unpoisoned(k->host + (size_t)nr * h, (rows - nr) * h, pz) >= 0 ||
        ow_unpoisoned(k->host + rows * h + (size_t)nr * G * 4, (rows - nr) * G * 4, pz) >= 0)
      return ow_fail(k->msg, "dispatch (fp8): rows or scales written past %u [%s]", nr, d->desc);
    if (cr_get(k, B_RIDX))
      return 1;
    const int32_t *ri = (const int32_t *)k->host;
    if (memcmp(ri, w8->topk_idx, (size_t)nr * K * 4) != 0)
      return ow_fail(k->msg, "dispatch (fp8): recv_topk_idx differs [%s]", d->desc);
    for (size_t i = (size_t)nr * K; i < (size_t)worst * K; i++)
      if (ri[i] != -1)
        return ow_fail(k->msg, "dispatch: padding row %zu has id %d, want -1 [%s]", i / K, ri[i],
                       d->desc);
    if (ow_unpoisoned(ri + (size_t)(worst ? worst : nr) * K,
                      (rows - (worst ? worst : nr)) * K * 4, pz) >= 0)
      return ow_fail(k->msg, "dispatch: recv_topk_idx written past its rows [%s]", d->desc);
    if (cr_get(k, B_RW))
      return 1;
    const float *rw = (const float *)k->host;
    if (memcmp(rw, w8->topk_weights, (size_t)nr * K * 4) != 0)
      return ow_fail(k->msg, "dispatch (fp8): recv_topk_weights differ [%s]", d->desc);
    for (size_t i = (size_t)nr * K; i < (size_t)worst * K; i++)
      if (rw[i] != 0.0f)
        return ow_fail(k->msg, "dispatch: padding row %zu has weight %g [%s]", i / K, rw[i],
                       d->desc);
    int32_t want_cnt[256];
    memcpy(want_cnt, w8->count, k->le * 4);
    ref_align_counts(want_cnt, k->le, e->align[r]);
    if (cr_get(k, B_CNT) || memcmp(k->host, want_cnt, k->le * 4) != 0)
      return ow_fail(k->msg, "dispatch: recv_count_per_expert is not the oracle's rounded to "
                     "multiples of %u [%s]", e->align[r], d->desc);
    /* Where the call waited: the same counts on the host as it returned, and no more. */
    if (!worst && (memcmp(host_cnt, want_cnt, k->le * 4) != 0 ||
                   ow_unpoisoned(host_cnt + k->le, 8 * 4, pz) >= 0))
      return ow_fail(k->msg, "dispatch: recv_count_per_expert_host is not the oracle's counts "
                     "rounded to multiples of %u, or written past %u [%s]", e->align[r], k->le,
                     d->desc);

    /* Cached, bf16, through the handle (num_worst_tokens as its dispatch had). */
    if (cr_put(k, B_X, d->in[r].x, (size_t)n * h * 2) || cr_poison(k, B_RX, pz))
      return 1;
    uint32_t cn = 0xdeadbeef;
    struct dep_dispatch_args cb = {.size = sizeof cb, .cached = 1, .x = CR_DEV(k, B_X),
                                   .num_tokens = n, .recv_x = CR_DEV(k, B_RX),
                                   .num_recv = worst ? NULL : &cn, .num_worst_tokens = worst};
    CALL(k, dep_dispatch(k->c, &cb, k->h, k->s), "dep_dispatch (cached)");
    if (!worst && cn != nr)
      return ow_fail(k->msg, "dispatch (cached): num_recv %u, want %u [%s]", cn, nr, d->desc);
    if (cr_get(k, B_RX) || memcmp(k->host, wb->x, (size_t)nr * h * 2) != 0)
      return ow_fail(k->msg, "dispatch (cached): recv_x differs from the oracle [%s]", d->desc);
    if (ow_unpoisoned(k->host + (size_t)nr * h * 2, (rows - nr) * h * 2, pz) >= 0)
      return ow_fail(k->msg, "dispatch (cached): recv_x written past %u [%s]", nr, d->desc);

    /* Weighted combine of the rows' recv_topk_weights (still in B_RW). */
    if (cr_poison(k, B_OUT, pz) || cr_poison(k, B_LRX, pz))
      return 1;
    struct dep_combine_args ca = {.size = sizeof ca, .x = CR_DEV(k, B_CX), .out = CR_DEV(k, B_OUT),
                                  .topk_weights = CR_DEV(k, B_RW),
                                  .out_topk_weights = CR_DEV(k, B_LRX)};
    CALL(k, dep_combine(k->c, &ca, k->h, k->s), "dep_combine (weights)");
    uint16_t *want = malloc(((size_t)n * h + 1) * 2);
    float *acc = malloc(h * 4);
    cr_want_combine(d, r, want, acc);
    int rc = cr_get(k, B_OUT) || cr_check_sum(k, d, &d->comb[r], want, n, k->mt, pz, "combine");
    free(want);
    free(acc);
    if (rc || cr_get(k, B_LRX))
      return 1;
    const float *ow = (const float *)k->host;
    for (uint32_t t = 0; t < n; t++)
      for (uint32_t j = 0; j < K; j++) {
        float ws = 0.0f; /* the host's order: sources ascending, float32 */
        for (uint32_t q = 0; q < d->sc.world; q++)
          for (uint32_t i = 0; i < d->disp[q].num_recv; i++)
            if (d->disp[q].from[i].rank == r && d->disp[q].from[i].token == t)
              ws += d->disp[q].topk_weights[(size_t)i * K + j];
        if (memcmp(&ow[(size_t)t * K + j], &ws, 4) != 0)
          return ow_fail(k->msg, "combine: out_topk_weights[%u][%u] = %g, want %g [%s]", t, j,
                         ow[(size_t)t * K + j], ws, d->desc);
      }
    if (ow_unpoisoned(ow + (size_t)n * K, (size_t)(k->mt - n) * K * 4, pz) >= 0)
      return ow_fail(k->msg, "combine: out_topk_weights written past num_tokens [%s]", d->desc);
  }
  return 0;
}

static const struct ow_scenario ext_scenarios[] = {
  /* world hidden topk experts max_tokens max_ll  routing  tokens  index  fp8 */
  {1, 256, 2, 4, 32, 8, P_RANDOM, T_MAX, DEP_INDEX_I64, 0},
  {2, 2048, 8, 16, 64, 64, P_DUP, T_MIXED, DEP_INDEX_I32, 0},
  {4, 128, 4, 16, 32, 32, P_RANDOM, T_MIXED, DEP_INDEX_I64, 0},
  {8, 7168, 8, 64, 16, 16, P_RANDOM, T_MAX, DEP_INDEX_I32, 0},
  {8, 128, 2, 8, 16, 16, P_ONE_RANK, T_ZERO, DEP_INDEX_I64, 0},
};

/* FP8 dispatch, num_worst_tokens (no synchronisation), expert_alignment, cached mode and a
 * weighted combine: each against the oracle, bit for bit. */
static void run_ext(const struct ow_scenario *sc, int salt) {
  ow_seed_init((uint64_t)salt);
  struct ext_gpu *e = malloc(sizeof *e);
  ck_assert_ptr_nonnull(e);
  ext_gpu_make(e, sc);
  struct cr_world w;
  cr_world_start(&w, NULL);
  char job[32];
  snprintf(job, sizeof job, "ext-%d", salt);
  cr_run_procs(&w, job, &e->d.shape, e->d.sc.world, ext_gpu_body, e, e->d.desc);
  cr_world_stop(&w);
  ext_gpu_free(e);
  free(e);
}

START_TEST(throughput_extensions_match_the_oracle) {
  CR_NEEDS_GPU();
  run_ext(&ext_scenarios[_i], 200 + _i);
}
END_TEST

/* ---- a budget below the world ------------------------------------------------------------ */

/*
 * $DEEPEP_KERNEL_CTAS below the world (kabi.h "SM budget"): the grid is the
 * budget's CTAs, each sending to several ranks in turn (a world of 3 on 2
 * CTAs: CTA 0 sends to ranks 0 and 2, CTA 1 to rank 1; of 8 on 1: all 8),
 * then receiving its share.  Every op, low-latency ones included, and the
 * throughput extensions (FP8, num_worst_tokens, alignment, cached, a
 * weighted combine), as the oracle says, twice, bit for bit.
 */
static const struct {
  bool ext; /* ext_scenarios[sc], else scenarios[sc] */
  uint32_t sc;
  const char *ctas;
} budgets[] = {
  {false, 5, "2"},  /* world 3: units not a multiple of the grid */
  {false, 6, "2"},  /* world 4, FP8 */
  {false, 8, "1"},  /* world 4, every row to one rank, one CTA */
  {false, 11, "2"}, /* world 8, mixed tokens */
  {false, 12, "1"}, /* world 8, hidden 7168, one CTA */
  {false, 13, "2"}, /* world 8, duplicate ids */
  {false, 17, "2"}, /* DeepEP's test_low_latency.py's defaults */
  {true, 2, "2"},   /* world 4, the extensions */
  {true, 3, "1"},   /* world 8, hidden 7168, the extensions on one CTA */
};

START_TEST(a_budget_below_the_world_loops_and_matches_the_oracle) {
  CR_NEEDS_GPU();
  setenv(CUOPS_CTAS_ENV, budgets[_i].ctas, 1); /* the rank processes inherit it */
  printf("cuda_ops budget: " CUOPS_CTAS_ENV "=%s\n", budgets[_i].ctas);
  if (budgets[_i].ext)
    run_ext(&ext_scenarios[budgets[_i].sc], 600 + _i);
  else
    run_scenario(&scenarios[budgets[_i].sc], 600 + _i, false);
  unsetenv(CUOPS_CTAS_ENV);
}
END_TEST

/* ---- combine's biases (deepep.h dep_combine_args bias_0, bias_1) ------------------------ */

/* A case and each rank's two biases, bf16 [num_tokens, hidden] in [-4, 4). */
struct bias_gpu {
  struct ow_case d;
  uint16_t *b[2][OW_MAXW];
};

/*
 * Per round a dispatch and a combine with biases, bit for bit the host
 * backend's single rounding (ow_want_combine, which check_ops_ext.c holds
 * the host backend to): both biases, bias_0 16-byte aligned (read as
 * vectors) and bias_1 only 2-byte aligned (element by element); bias_1
 * alone after a cached dispatch; bias_0 alone in a weighted combine.
 */
static int body_bias(struct rk *k, void *arg) {
  const struct bias_gpu *e = arg;
  const struct ow_case *d = &e->d;
  const uint32_t r = k->rank, h = k->h_, n = d->in[r].num_tokens, nr = d->disp[r].num_recv;
  const size_t cells = (size_t)n * h;
  if (cr_put(k, B_X, d->in[r].x, cells * 2) ||
      cr_put(k, B_IDX, d->idx[r], (size_t)n * k->K * (d->sc.itype == DEP_INDEX_I64 ? 8 : 4)) ||
      cr_put(k, B_W, d->in[r].topk_weights, (size_t)n * k->K * 4) ||
      cr_put(k, B_CX, d->cx[r], (size_t)nr * h * 2))
    return 1;
  /* bias_0 at the allocation (aligned), bias_1 two bytes past a 16-byte boundary. */
  CUdeviceptr bm = 0;
  const size_t b1_off = (cells * 2 + 15) / 16 * 16 + 2;
  CR_CU(k, k->cu->cuMemAlloc(&bm, b1_off + cells * 2 + 2), "cuMemAlloc (biases)");
  uint16_t *want = malloc(cells * 2 + 2);
  float *acc = malloc(h * 4);
  int rc = cr_put_at(k, bm, e->b[0][r], cells * 2) ||
           cr_put_at(k, bm + b1_off, e->b[1][r], cells * 2);
  const void *dev[2] = {(const void *)(uintptr_t)bm, (const void *)(uintptr_t)(bm + b1_off)};
  for (int round = 0; round < 3 && rc == 0; round++) {
    const uint8_t pz = round & 1 ? 0x5A : 0xA5;
    const bool g0 = round != 1, g1 = round != 2;
    uint32_t nrecv = 0;
    struct dep_dispatch_args da = {
        .size = sizeof da, .x = CR_DEV(k, B_X), .topk_idx = CR_DEV(k, B_IDX),
        .index_type = d->sc.itype, .topk_weights = CR_DEV(k, B_W), .num_tokens = n,
        .recv_x = CR_DEV(k, B_RX), .recv_topk_idx = CR_DEV(k, B_RIDX),
        .recv_topk_weights = CR_DEV(k, B_RW), .recv_count_per_expert = CR_DEV(k, B_CNT),
        .num_recv = &nrecv};
    CALL(k, dep_dispatch(k->c, &da, k->h, k->s), "dep_dispatch");
    if (round == 1) {
      struct dep_dispatch_args cb = {.size = sizeof cb, .cached = 1, .x = CR_DEV(k, B_X),
                                     .num_tokens = n, .recv_x = CR_DEV(k, B_RX),
                                     .num_recv = &nrecv};
      CALL(k, dep_dispatch(k->c, &cb, k->h, k->s), "dep_dispatch (cached)");
    }
    if (cr_poison(k, B_OUT, pz)) {
      rc = 1;
      break;
    }
    struct dep_combine_args ca = {.size = sizeof ca, .x = CR_DEV(k, B_CX), .out = CR_DEV(k, B_OUT),
                                  .bias_0 = g0 ? dev[0] : NULL, .bias_1 = g1 ? dev[1] : NULL};
    if (round == 2) /* the rows' recv_topk_weights, still in B_RW */
      ca.topk_weights = CR_DEV(k, B_RW), ca.out_topk_weights = CR_DEV(k, B_LRX);
    CALL(k, dep_combine(k->c, &ca, k->h, k->s), "dep_combine (bias)");
    ow_want_combine(d, r, g0 ? e->b[0][r] : NULL, g1 ? e->b[1][r] : NULL, want, acc);
    if ((rc = cr_get(k, B_OUT)) != 0)
      break;
    const uint16_t *got = (const uint16_t *)k->host;
    for (size_t i = 0; i < cells && rc == 0; i++)
      if (got[i] != want[i])
        rc = ow_fail(k->msg, "combine (bias_0 %s, bias_1 %s): token %zu channel %zu is 0x%04x, "
                     "the host backend's 0x%04x [%s]", g0 ? "aligned" : "NULL",
                     g1 ? "2-byte aligned" : "NULL", i / h, i % h, got[i], want[i], d->desc);
    if (rc == 0 && ow_unpoisoned(k->host + cells * 2, (size_t)k->mt * h * 2 - cells * 2, pz) >= 0)
      rc = ow_fail(k->msg, "combine (bias): out written past num_tokens [%s]", d->desc);
  }
  k->cu->cuStreamSynchronize(k->s);
  k->cu->cuMemFree(bm);
  free(want);
  free(acc);
  return rc;
}

/* Combine with biases: the host backend's result, bit for bit, on every scenario of ext's. */
START_TEST(combine_with_biases_matches_the_host_backend) {
  CR_NEEDS_GPU();
  ow_seed_init(300 + (uint64_t)_i);
  struct bias_gpu *e = calloc(1, sizeof *e);
  ck_assert_ptr_nonnull(e);
  ow_case_make(&e->d, &ext_scenarios[_i], 0);
  const uint32_t h = e->d.sc.hidden;
  for (uint32_t r = 0; r < e->d.sc.world; r++)
    for (int j = 0; j < 2; j++) {
      const size_t cells = (size_t)e->d.in[r].num_tokens * h;
      e->b[j][r] = malloc(cells * 2 + 2);
      ck_assert_ptr_nonnull(e->b[j][r]);
      for (size_t i = 0; i < cells; i++)
        e->b[j][r][i] = host_ops_float_to_bf16(ldexpf(ow_unif() * 2.0f - 1.0f, 2));
    }
  struct cr_world w;
  cr_world_start(&w, NULL);
  char job[32];
  snprintf(job, sizeof job, "bias-%d", _i);
  cr_run_procs(&w, job, &e->d.shape, e->d.sc.world, body_bias, e, e->d.desc);
  cr_world_stop(&w);
  for (uint32_t r = 0; r < e->d.sc.world; r++)
    free(e->b[0][r]), free(e->b[1][r]);
  ow_case_free(&e->d);
  free(e);
}
END_TEST

/* ---- handles in memory the caller lends (dep_handle_new_in) ------------------------------ */

#define LENT_GUARD 4096u
#define LENT_POISON 0xa5

/* The lent memory's guards (LENT_GUARD bytes each side of its n) still poisoned: 0, or 1
 * with k->msg. */
static int lent_guards_kept(struct rk *k, CUdeviceptr m, size_t n, const char *when) {
  uint8_t g[2][LENT_GUARD];
  CR_CU(k, k->cu->cuStreamSynchronize(k->s), "cuStreamSynchronize");
  CR_CU(k, k->cu->cuMemcpyDtoH(g[0], m, LENT_GUARD), "cuMemcpyDtoH");
  CR_CU(k, k->cu->cuMemcpyDtoH(g[1], m + LENT_GUARD + n, LENT_GUARD), "cuMemcpyDtoH");
  for (int i = 0; i < 2; i++)
    if (ow_unpoisoned(g[i], LENT_GUARD, LENT_POISON) >= 0)
      return ow_fail(k->msg, "rank %u: %s: the library wrote outside the handle's %zu bytes "
                     "(%s guard)", k->rank, when, n, i ? "upper" : "lower");
  return 0;
}

/* A refused dep_handle_new_in: DEP_ERR_INVALID, its message holding want. */
static int lent_refused(struct rk *k, void *mem, size_t n, const char *want) {
  dep_handle_t *h = NULL;
  int rc = dep_handle_new_in(k->c, mem, n, &h);
  if (rc != DEP_ERR_INVALID || h != NULL || strstr(dep_errmsg(k->c), want) == NULL)
    return ow_fail(k->msg, "rank %u: dep_handle_new_in(%p, %zu): %s (\"%s\"), want "
                   "DEP_ERR_INVALID saying \"%s\"", k->rank, mem, n, dep_errname(rc),
                   dep_errmsg(k->c), want);
  return 0;
}

/*
 * The rank's handle replaced by one in cuMemAlloc'd memory of its GPU
 * (poisoned, with poisoned guards): host memory, a misaligned or short
 * one refused first; then every op's rounds against the oracle, twice,
 * bit-identical; the guards kept; and after dep_handle_free the memory
 * still the caller's to cuMemFree.
 */
static int body_lent(struct rk *k, void *arg) {
  const struct ow_case *d = arg;
  size_t n = 0;
  CALL(k, dep_handle_bytes(k->c, &n), "dep_handle_bytes");
  CUdeviceptr m = 0;
  CR_CU(k, k->cu->cuMemAlloc(&m, 2 * LENT_GUARD + n), "cuMemAlloc");
  CR_CU(k, k->cu->cuMemsetD8(m, LENT_POISON, 2 * LENT_GUARD + n), "cuMemsetD8");
  void *mem = (void *)(uintptr_t)(m + LENT_GUARD);
  void *host = aligned_alloc(DEP_HANDLE_ALIGN, dep_round_up(n, DEP_HANDLE_ALIGN));
  int rc = host == NULL ? ow_fail(k->msg, "out of memory") : 0;
  if (rc == 0)
    rc = lent_refused(k, host, n, "is not device memory of this rank's GPU") ||
         lent_refused(k, (uint8_t *)mem + 8, n, "256-byte aligned") ||
         lent_refused(k, mem, n - 1, "dep_handle_bytes");
  free(host);
  if (rc != 0)
    return rc;
  dep_handle_free(k->h);
  k->h = NULL;
  CALL(k, dep_handle_new_in(k->c, mem, n, &k->h), "dep_handle_new_in");
  uint64_t first = 0;
  for (int round = 0; round < 2 && rc == 0; round++) {
    uint64_t dig = 0;
    rc = cr_upload(k, d) || cr_round_tp(k, d, 0xA5, &dig) || cr_round_ll(k, d, 0, 0xA5, &dig) ||
         (d->sc.fp8 && cr_round_ll(k, d, 1, 0xA5, &dig)) ||
         lent_guards_kept(k, m, n, "the rounds");
    if (rc == 0 && round == 1 && dig != first)
      rc = ow_fail(k->msg, "rank %u: round 1 repeats round 0's inputs but its outputs differ "
                   "[%s]", k->rank, d->desc);
    first = dig;
  }
  if (rc != 0)
    return rc;
  CR_CU(k, k->cu->cuStreamSynchronize(k->s), "cuStreamSynchronize");
  dep_handle_free(k->h);
  k->h = NULL;
  if (lent_guards_kept(k, m, n, "dep_handle_free"))
    return 1;
  /* The memory is still ours: a library that freed it makes this fail. */
  CR_CU(k, k->cu->cuMemFree(m), "cuMemFree of the lent memory after dep_handle_free");
  return 0;
}

static const struct ow_scenario lent_scenarios[] = {
  /* world hidden topk experts max_tokens max_ll  routing  tokens  index  fp8 */
  {1, 128, 2, 4, 8, 8, P_RANDOM, T_MAX, DEP_INDEX_I64, 0},
  {2, 2048, 2, 8, 128, 64, P_RANDOM, T_MIXED, DEP_INDEX_I32, 1},
  {8, 128, 8, 64, 16, 16, P_RANDOM, T_MIXED, DEP_INDEX_I64, 1},
};

/* Every op through a handle whose arrays are in the caller's device memory, as the oracle
 * says; the memory outside its bytes untouched and never freed by the library. */
START_TEST(ops_through_a_handle_in_lent_device_memory_match_the_oracle) {
  CR_NEEDS_GPU();
  ow_seed_init(400 + (uint64_t)_i);
  struct ow_case *d = malloc(sizeof *d);
  ck_assert_ptr_nonnull(d);
  ow_case_make(d, &lent_scenarios[_i], lent_scenarios[_i].fp8);
  struct cr_world w;
  cr_world_start(&w, NULL);
  char job[32];
  snprintf(job, sizeof job, "lent-%d", _i);
  cr_run_procs(&w, job, &d->shape, d->sc.world, body_lent, d, d->desc);
  cr_world_stop(&w);
  ow_case_free(d);
  free(d);
}
END_TEST

/* Where the ranks go, said once: an unchecked fixture runs in the runner
 * process (before the oracle's tests), which the probe keeps free of CUDA. */
static void say_placement(void) {
  if (!cr_on_cuda())
    return;
  struct tu_gpus g;
  char why[256] = "";
  int rc = tu_gpus_probe(&g, why, sizeof why);
  if (rc > 0 && g.n > 1)
    printf("cuda_ops: ranks spread over %d GPUs (rank r on GPU r %% %d; %d visible)\n", g.n, g.n,
           g.visible);
  else if (rc > 0)
    printf("cuda_ops: every rank on GPU 0 (%d visible; DEP_TEST_GPUS=N or all spreads them)\n",
           g.visible);
  else if (rc < 0)
    printf("cuda_ops: %s\n", why); /* and every test fails saying so */
  fflush(stdout);
}

/*
 * The low-latency calls' wait_cost (DeepEP's *_wait_recv_cost_stats): each
 * receive adds, for every source, the clock64 cycles it waited for that
 * source's post, which is above 0 (the wait reads the flag at least once),
 * so two calls leave each counter above what one left; the dispatch's and
 * combine's counters are their own; a round without them after is still
 * the oracle's.  Counters: the first 2 * world int64 of B_LRANGE, zeroed.
 */
static int body_wait_cost(struct rk *k, void *arg) {
  const struct ow_case *d = arg;
  const uint32_t W = d->sc.world;
  if (cr_upload(k, d) || cr_poison(k, B_LRANGE, 0))
    return 1;
  int64_t *cost = CR_DEV(k, B_LRANGE);
  struct dep_ll_dispatch_args la = {.size = sizeof la, .x = CR_DEV(k, B_X),
                                    .topk_idx = CR_DEV(k, B_IDX), .index_type = d->sc.itype,
                                    .num_tokens = d->in_ll[k->rank].num_tokens,
                                    .recv_x = CR_DEV(k, B_LRX), .recv_count = CR_DEV(k, B_LCNT),
                                    .wait_cost = cost};
  struct dep_ll_combine_args lc = {.size = sizeof lc, .x = CR_DEV(k, B_LX),
                                   .topk_idx = CR_DEV(k, B_IDX), .index_type = d->sc.itype,
                                   .topk_weights = CR_DEV(k, B_W), .out = CR_DEV(k, B_LOUT),
                                   .wait_cost = cost + W};
  int64_t once[2 * OW_MAXW];
  for (int round = 0; round < 2; round++) {
    CALL(k, dep_ll_dispatch(k->c, &la, k->h, k->s), "dep_ll_dispatch");
    CALL(k, dep_ll_combine(k->c, &lc, k->h, k->s), "dep_ll_combine");
    if (cr_get(k, B_LRANGE))
      return 1;
    const int64_t *got = (const int64_t *)k->host;
    for (uint32_t i = 0; i < 2 * W; i++) {
      if (got[i] <= (round == 0 ? 0 : once[i]))
        return ow_fail(k->msg, "rank %u: %s wait_cost[%u] is %lld after call %d%s [%s]",
                       k->rank, i < W ? "dispatch" : "combine", i % W, (long long)got[i],
                       round + 1, round == 0 ? "" : ", not above the first call's", d->desc);
      once[i] = got[i];
    }
  }
  uint64_t dig = 0;
  return cr_round_ll(k, d, 0, 0xA5, &dig);
}

START_TEST(low_latency_wait_costs_add_each_sources_wait) {
  CR_NEEDS_GPU();
  ow_seed_init(240);
  struct ow_case *d = malloc(sizeof *d);
  ck_assert_ptr_nonnull(d);
  /* Two local experts at least: B_LRANGE ([local experts, world] int64) holds both counters. */
  const struct ow_scenario sc = {4, 128, 4, 16, 16, 16, P_RANDOM, T_MAX, DEP_INDEX_I64, 0};
  ow_case_make(d, &sc, 0);
  struct cr_world w;
  cr_world_start(&w, NULL);
  cr_run_procs(&w, "wait-cost", &d->shape, sc.world, body_wait_cost, d, d->desc);
  cr_world_stop(&w);
  ow_case_free(d);
  free(d);
}
END_TEST

Suite *cuda_ops_suite(void);
Suite *cuda_ops_suite(void) {
  Suite *s = suite_create("cuda_ops");
  TCase *tc = tcase_create("oracle");
  tcase_set_tags(tc, "gpu");
  tcase_add_unchecked_fixture(tc, say_placement, NULL);
  tcase_set_timeout(tc, 240);
  tcase_add_loop_test(tc, ranks_as_processes_match_the_oracle, 0,
                      (int)(sizeof scenarios / sizeof scenarios[0]));
  tcase_add_test(tc, two_hundred_forty_calls_back_to_back_stay_correct);
  tcase_add_loop_test(tc, throughput_extensions_match_the_oracle, 0,
                      (int)(sizeof ext_scenarios / sizeof ext_scenarios[0]));
  tcase_add_loop_test(tc, combine_with_biases_matches_the_host_backend, 0,
                      (int)(sizeof ext_scenarios / sizeof ext_scenarios[0]));
  tcase_add_loop_test(tc, ops_through_a_handle_in_lent_device_memory_match_the_oracle, 0,
                      (int)(sizeof lent_scenarios / sizeof lent_scenarios[0]));
  tcase_add_test(tc, low_latency_wait_costs_add_each_sources_wait);
  suite_add_tcase(s, tc);
  /* Its own case, so that it can run outside MPS alone (CK_RUN_CASE=threads). */
  TCase *th = tcase_create("threads");
  tcase_set_tags(th, "gpu");
  tcase_set_timeout(th, 240);
  tcase_add_loop_test(th, ranks_as_threads_of_one_process_match_the_oracle, 0,
                      (int)(sizeof thread_scenarios / sizeof thread_scenarios[0]));
  suite_add_tcase(s, th);
  /* Its own case, so that a GPU pass can run it alone (CK_RUN_CASE=budget). */
  TCase *tb = tcase_create("budget");
  tcase_set_tags(tb, "gpu");
  tcase_set_timeout(tb, 240);
  tcase_add_loop_test(tb, a_budget_below_the_world_loops_and_matches_the_oracle, 0,
                      (int)(sizeof budgets / sizeof budgets[0]));
  suite_add_tcase(s, tb);
  TCase *tcr = tcase_create("crowd");
  tcase_set_tags(tcr, "gpu");
  tcase_set_timeout(tcr, 240);
  tcase_add_test(tcr, ranks_crowding_one_gpu_stay_within_their_budgets_and_match_the_oracle);
  suite_add_tcase(s, tcr);
  suite_add_tcase(s, cuda_ops_faults_tcase()); /* after threads, as it always ran */
  suite_add_tcase(s, cuda_ops_mask_tcase());
  suite_add_tcase(s, cuda_ops_split_tcase());
  suite_add_tcase(s, cuda_ops_stream_tcase());
  suite_add_tcase(s, cuda_ops_stream_lend_tcase());
  suite_add_tcase(s, cuda_ops_stream_budget_tcase());
  TCase *ts = tcase_create("timesliced");
  tcase_set_tags(ts, "gpu");
  tcase_set_timeout(ts, 240);
  tcase_add_test(ts, time_sliced_ranks_make_progress);
  suite_add_tcase(s, ts);
  return s;
}
