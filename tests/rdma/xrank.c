/*
 * xrank.c — one rank of the Soft-RoCE correctness scenario
 * (tests/rdma/xnode2.sh): attach, run rounds of every operation (layout,
 * dispatch, combine, LL dispatch with FP8 in odd rounds, LL combine) on
 * random inputs drawn from $DEP_TEST_SEED, check each against the oracle
 * as check_xnode does (tests/xnround.h), and print the digest of all it
 * received, which must be the same whether the job spans nodes or not;
 * then split low-latency calls in two interleavings (xn_round_split).
 * Compiled by the scenario against the build's objects.
 *
 *   xrank SOCKET JOB RANK LOCAL_RANK LOCAL_WORLD ROUNDS
 *
 * Prints "rank R: N rounds ok in X ms, digest 0x..." and exits 0, or says
 * what failed and exits 1.  It runs as a Check test (no fork) because the
 * oracle's helpers use Check's assertions.
 *
 * With $XRANK_ONCE set (tests/rdma/xnode2once.sh) the rank instead makes one
 * throughput dispatch of top-4 of 8 experts (most tokens go to both ranks of
 * the other node), checks it against the oracle bit for bit and prints
 * "rank R: once ok: N rows for other nodes, M for their ranks, B bytes a
 * row" (or "rank R: once: ..." or "rank R: attach: ..." saying what
 * failed; N: its tokens with an expert on the other node, each once; M: each
 * once per rank of it; B: the layout's row_bytes with $XRANK_CHUNK rows a
 * chunk); then it holds the job until the file $XRANK_ONCE names exists,
 * so that the daemons' counters are read while it runs.
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <time.h>
#include <unistd.h>

#include "deepep.h"
#include "opsworld.h"
#include "slab.h"
#include "xnround.h"

/* 4 ranks (two per node), 256 channels, top-2 of 8 experts, up to 16
 * tokens a rank (some ranks fewer, some none), int32 indices;
 * $XRANK_HIDDEN (a multiple of 128) and $XRANK_TOKENS make the blocks
 * larger, for measuring. */
static struct ow_scenario xr_scenario = {4, 256, 2, 8, 16, 16, P_RANDOM, T_MIXED,
                                         DEP_INDEX_I32, 0};

/* $name as a number in [lo, hi] (a multiple of mult), else dflt; -1 when it is set but not such. */
static long xr_env(const char *name, long dflt, long lo, long hi, long mult) {
  const char *e = getenv(name);
  if (e == NULL || *e == '\0')
    return dflt;
  char *end;
  long v = strtol(e, &end, 10);
  return *end == '\0' && v >= lo && v <= hi && v % mult == 0 ? v : -1;
}

/* Rank `rank`'s one dispatch of d on client c against the oracle, its
 * counts of rows for the other node, and the hold ($XRANK_ONCE): 0 or 1. */
static int xr_once(dep_client_t *c, const struct ow_case *d, uint32_t rank, uint32_t lws,
                   const char *hold) {
  struct ow_outs o;
  ow_outs_alloc(&o, d);
  const struct ref_rank_in *in = &d->in[rank];
  const struct ref_dispatch_out *want = &d->disp[rank];
  dep_handle_t *hd = NULL;
  int rc = dep_handle_new(c, &hd);
  struct dep_dispatch_args da = {.size = sizeof da, .x = in->x, .topk_idx = d->idx[rank],
                                 .index_type = d->sc.itype, .topk_weights = in->topk_weights,
                                 .num_tokens = in->num_tokens, .recv_x = o.rx,
                                 .recv_topk_idx = o.ridx, .recv_topk_weights = o.rw,
                                 .recv_count_per_expert = o.cnt, .num_recv = &o.num_recv};
  if (rc == 0)
    rc = dep_dispatch(c, &da, hd, NULL);
  const size_t n = rc == 0 ? o.num_recv : 0, h = d->sc.hidden, k = d->sc.topk;
  if (rc != 0) {
    printf("rank %u: once: dispatch: %s: %s\n", rank, dep_errname(rc), dep_errmsg(c));
  } else if (n != want->num_recv || memcmp(o.rx, want->x, n * h * 2) != 0 ||
             memcmp(o.rw, want->topk_weights, n * k * sizeof(float)) != 0 ||
             memcmp(o.ridx, want->topk_idx, n * k * 4) != 0) {
    printf("rank %u: once: %zu rows, the oracle's %u, or their bytes, ids or weights differ\n",
           rank, n, want->num_recv);
    rc = 1;
  }
  /* The node of rank r: ranks lws * i .. lws * (i + 1) - 1 are node i's. */
  uint64_t rows = 0, per_rank = 0;
  const int32_t *idx = d->idx[rank];
  for (uint32_t t = 0; rc == 0 && t < in->num_tokens; t++) {
    bool node_hit = false, rank_hit[OW_MAXW] = {false};
    for (uint32_t j = 0; j < k; j++) {
      const int32_t e = idx[(size_t)t * k + j];
      const uint32_t r = e >= 0 ? (uint32_t)e / d->le : 0;
      if (e < 0 || r / lws == rank / lws)
        continue;
      node_hit = true;
      rank_hit[r] = true;
    }
    rows += node_hit;
    for (uint32_t r = 0; r < d->sc.world; r++)
      per_rank += rank_hit[r];
  }
  struct dep_slab_layout lay;
  char why[256];
  const long chunk = getenv("XRANK_CHUNK") ? atol(getenv("XRANK_CHUNK")) : 0;
  if (rc == 0 && dep__slab_layout_nodes(&d->shape, d->sc.world, lws, (uint32_t)chunk, &lay, why,
                                        sizeof why) != 0) {
    printf("rank %u: once: the layout: %s\n", rank, why);
    rc = 1;
  }
  if (rc == 0)
    printf("rank %u: once ok: %llu rows for other nodes, %llu for their ranks, %llu bytes a "
           "row\n", rank, (unsigned long long)rows, (unsigned long long)per_rank,
           (unsigned long long)lay.row_bytes);
  fflush(stdout);
  /* Held until the scenario has read the daemons' counters (it creates the file), at most
   * 10 minutes: far past the scenario's own timeout, so that a rank never outlives it. */
  for (int i = 0; i < 12000 && access(hold, F_OK) != 0; i++)
    nanosleep(&(struct timespec){0, 50000000}, NULL);
  if (hd != NULL)
    dep_handle_free(hd);
  ow_outs_free(&o);
  return rc == 0 ? 0 : 1;
}

static char **xr_argv;
static int xr_rc = 1;

static int xr_main(char **argv) {
  long hid = xr_env("XRANK_HIDDEN", 256, 128, 8192, 128),
       tok = xr_env("XRANK_TOKENS", 16, 1, 256, 1);
  if (hid < 0 || tok < 0) {
    fprintf(stderr, "xrank: XRANK_HIDDEN is a multiple of 128 in 128..8192, XRANK_TOKENS 1..256\n");
    return 2;
  }
  xr_scenario.hidden = (uint32_t)hid;
  xr_scenario.max_tokens = xr_scenario.max_ll = (uint32_t)tok;
  uint32_t rank = (uint32_t)atoi(argv[3]), rounds = (uint32_t)atoi(argv[6]);
  const char *once = getenv("XRANK_ONCE");
  if (once != NULL) {
    /* Top-4 of 8 experts, every rank its most tokens: a token for both ranks of a node. */
    xr_scenario.topk = 4;
    xr_scenario.tokens = T_MAX;
    xr_scenario.max_ll = 1; /* no LL call: the oracle's LL rows would only cost time */
  }
  ow_seed_init(0);
  static struct ow_case d;
  ow_case_make(&d, &xr_scenario, 1);
  if (rank >= d.sc.world) {
    fprintf(stderr, "xrank: rank %u of a world of %u\n", rank, d.sc.world);
    return 2;
  }
  struct dep_attach_args a = {.size = sizeof a, .rank = rank, .world_size = d.sc.world,
                              .local_rank = (uint32_t)atoi(argv[4]),
                              .local_world_size = (uint32_t)atoi(argv[5]), .shape = d.shape};
  snprintf(a.job_id, sizeof a.job_id, "%s", argv[2]);
  dep_client_t *c = NULL;
  int rc = dep_client_new(&c);
  if (rc == 0)
    rc = dep_connect(c, argv[1]);
  if (rc == 0)
    rc = dep_attach(c, &a);
  if (rc != 0) {
    printf("rank %u: attach: %s: %s\n", rank, dep_errname(rc), c ? dep_errmsg(c) : "");
    return 1;
  }
  if (once != NULL) {
    rc = xr_once(c, &d, rank, a.local_world_size, once);
    dep_detach(c);
    dep_client_free(c);
    ow_case_free(&d);
    return rc;
  }
  struct ow_outs o;
  ow_outs_alloc(&o, &d);
  static struct xn_result res;
  int64_t t0 = xn_mono_ms();
  uint32_t i = 0;
  for (; i < rounds && rc == 0; i++)
    rc = xn_round(c, &d, rank, (int)(i & 1), &o, &res);
  int64_t ms = xn_mono_ms() - t0;
  if (rc != 0)
    printf("rank %u: round %u: %s\n", rank, i, res.msg);
  /* Then split calls (their taken words go back over the data path too: host_ops.h "Split
   * calls"), each receive against the oracle; the digest is the whole rounds'. */
  struct ow_outs so[2];
  ow_outs_alloc(&so[0], &d);
  ow_outs_alloc(&so[1], &d);
  static struct xn_result sres;
  if (rc == 0 && (rc = xn_round_split(c, &d, &d, rank, so, NULL, NULL, &sres)) != 0)
    printf("rank %u: %s\n", rank, sres.msg);
  ow_outs_free(&so[0]);
  ow_outs_free(&so[1]);
  if (rc == 0)
    printf("rank %u: %u rounds ok in %lld ms, digest 0x%016llx [%s]\n", rank, rounds,
           (long long)ms, (unsigned long long)res.digest, d.desc);
  ow_outs_free(&o);
  dep_detach(c);
  dep_client_free(c);
  ow_case_free(&d);
  return rc == 0 ? 0 : 1;
}

START_TEST(xrank) { xr_rc = xr_main(xr_argv); }
END_TEST

int main(int argc, char **argv) {
  if (argc != 7) {
    fprintf(stderr, "usage: xrank SOCKET JOB RANK LOCAL_RANK LOCAL_WORLD ROUNDS\n");
    return 2;
  }
  if (getenv("DEP_TEST_SEED") == NULL) {
    fprintf(stderr, "xrank: set DEP_TEST_SEED (the same on every node)\n");
    return 2;
  }
  xr_argv = argv;
  Suite *s = suite_create("xrank");
  TCase *tc = tcase_create("xrank");
  tcase_set_timeout(tc, 0);
  tcase_add_test(tc, xrank);
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  srunner_set_fork_status(sr, CK_NOFORK);
  srunner_run_all(sr, CK_SILENT);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed != 0 ? 1 : xr_rc;
}
