/*
 * check_stats_world.c — suite stats_world: the stats of a job of more
 * ranks than one node holds (DESIGN §10), through two real daemons and 128
 * real rank processes on the host backend: each daemon's deepepctl stats
 * gives, for each of its ranks, the tokens it sends to every rank of the
 * job (rank 100 among them) as the oracle counts them, and the node's
 * balance summary, in JSON and text.  The rest of the stats are
 * check_stats.c's.
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "ctl_view.h"
#include "daemonwire.h"
#include "nodes.h"
#include "opsworld.h"
#include "testutil.h"
#include "xnjob.h"

#define SW_WORLD 128u
/* Ceilings for 128 rank processes on a loaded 2-core machine, far above the seconds they
 * take (check_bigworld.c's): the attach timeout above the test's own. */
#define SW_ATTACH_TIMEOUT_MS 180000
#define SW_OP_TIMEOUT_MS 60000

/* The tokens rank g's layout sends to rank d: its tokens with an expert on d. */
static uint32_t sw_tokens(const struct ow_case *c, uint32_t g, uint32_t d) {
  const struct ref_rank_in *in = &c->in[g];
  uint32_t n = 0;
  for (uint32_t t = 0; t < in->num_tokens; t++) {
    bool to_d = false;
    for (uint32_t k = 0; k < c->sc.topk; k++) {
      int64_t e = in->topk_idx[(size_t)t * c->sc.topk + k];
      to_d |= e >= 0 && (uint32_t)(e / c->le) == d;
    }
    n += to_d;
  }
  return n;
}

/* deepepctl's text (no --json) on node i, into out. */
static void sw_ctl_text(const struct nodes *ns, int i, const char *what, char *out, size_t len) {
  char cmd[700];
  dw_sfmt(cmd, sizeof cmd, "%s -s %s %s", tu_bin("deepepctl"), ns->d[i].sock, what);
  FILE *f = popen(cmd, "r");
  ck_assert_ptr_nonnull(f);
  size_t got = fread(out, 1, len - 1, f);
  out[got] = '\0';
  ck_assert_int_eq(pclose(f), 0);
}

/* Rank g's "tokens_to" in a stats --json answer: every count equal to the oracle's. */
static void sw_expect_tokens_to(const char *json, const struct ow_case *c, uint32_t g) {
  char want[128];
  /* The rank table's row (an op row has "op" after its rank). */
  dw_sfmt(want, sizeof want, "\"job\":\"st128\",\"rank\":%u,\"device\"", g);
  const char *row = strstr(json, want);
  ck_assert_msg(row != NULL, "no rank row for rank %u in: %.2000s", g, json);
  const char *p = strstr(row, "\"tokens_to\":[");
  const char *end = strchr(row, '}');
  ck_assert_msg(p != NULL && p < end, "rank %u's row has no tokens_to: %.2000s", g, row);
  p += strlen("\"tokens_to\":[");
  for (uint32_t d = 0; d < SW_WORLD; d++) {
    char *next;
    unsigned long v = strtoul(p, &next, 10);
    ck_assert_msg(next != p, "rank %u: tokens_to ends after %u counts", g, d);
    ck_assert_msg(v == sw_tokens(c, g, d), "rank %u sends %lu tokens to rank %u, want %u", g, v,
                  d, sw_tokens(c, g, d));
    p = next + (*next == ',');
  }
  ck_assert_msg(*p == ']', "rank %u: tokens_to holds more than %u counts", g, SW_WORLD);
}

/*
 * Node i's balance row, its senders being ranks first..first + 63: the tokens they send each
 * rank summed, the least, median and most of those sums, the most over the mean, and the
 * ranks receiving most (most first, the lower rank among equals), in JSON and in the text.
 */
static void sw_expect_balance(const char *json, const char *text, const struct ow_case *c,
                              uint32_t first) {
  uint64_t to[SW_WORLD] = {0}, sorted[SW_WORLD], total = 0;
  for (uint32_t g = first; g < first + DEP_MAX_LOCAL_RANKS; g++)
    for (uint32_t d = 0; d < SW_WORLD; d++)
      to[d] += sw_tokens(c, g, d);
  for (uint32_t d = 0; d < SW_WORLD; d++) {
    total += to[d];
    uint32_t k = d;
    for (; k > 0 && sorted[k - 1] > to[d]; k--)
      sorted[k] = sorted[k - 1];
    sorted[k] = to[d];
  }
  ck_assert_uint_gt(total, 0);
  char tops[128] = "", ranks[64] = "";
  uint32_t top[CTL_BALANCE_TOP], ntop = 0;
  for (uint32_t t = 0; t < CTL_BALANCE_TOP; t++) {
    int best = -1;
    for (uint32_t d = 0; d < SW_WORLD; d++) {
      bool taken = false;
      for (uint32_t k = 0; k < ntop; k++)
        taken |= top[k] == d;
      if (!taken && to[d] > 0 && (best < 0 || to[d] > to[best]))
        best = (int)d;
    }
    if (best < 0)
      break;
    top[ntop++] = (uint32_t)best;
    size_t ut = strlen(tops), ur = strlen(ranks);
    snprintf(tops + ut, sizeof tops - ut, "%s%d:%llu", t > 0 ? " " : "", best,
             (unsigned long long)to[best]);
    snprintf(ranks + ur, sizeof ranks - ur, "%s%d", t > 0 ? "," : "", best);
  }
  const uint64_t skew = sorted[SW_WORLD - 1] * SW_WORLD * 1000 / total;
  char want[512];
  dw_sfmt(want, sizeof want,
          "{\"job\":\"st128\",\"ranks\":%u,\"world\":%u,\"tokens\":%llu,\"to_min\":%llu,"
          "\"to_median\":%llu,\"to_max\":%llu,\"max_over_mean\":%llu.%03llu,\"top\":\"%s\","
          "\"top_ranks\":[%s]}",
          DEP_MAX_LOCAL_RANKS, SW_WORLD, (unsigned long long)total,
          (unsigned long long)sorted[0], (unsigned long long)sorted[(SW_WORLD - 1) / 2],
          (unsigned long long)sorted[SW_WORLD - 1], (unsigned long long)(skew / 1000),
          (unsigned long long)(skew % 1000), tops, ranks);
  const char *bal = strstr(json, "\"balance\":[");
  ck_assert_msg(bal != NULL && strstr(bal, want) != NULL, "\"%s\" not in: %.3000s", want,
                bal != NULL ? bal : json);
  /* The text is the summary: the same row, and no rank's counts (those are JSON's). */
  const char *line = strstr(text, "st128  64/128");
  ck_assert_msg(line != NULL, "no balance line for st128 in:\n%s", text);
  const char *eol = strchr(line, '\n');
  ck_assert_msg(strstr(line, tops) != NULL && strstr(line, tops) < eol,
                "the balance line does not name \"%s\":\n%.*s", tops, (int)(eol - line), line);
  ck_assert_msg(strstr(text, "tokens_to") == NULL && strstr(text, "TOKENS_TO") == NULL,
                "the text shows the per-rank counts:\n%s", text);
}

/*
 * A job of 128 ranks over two daemons (64 a node, check_bigworld.c's placement) runs a round
 * of every op; then each daemon's deepepctl stats --json gives, for each of its ranks, the
 * tokens its newest layout sends to every rank of the job, the oracle's counts exactly (rank
 * 100 among them: before, the stats page and STATS_RANK held counts for ranks 0..63 only, and
 * stats showed none), and both the JSON and the text give the node's balance summary.  The
 * job has ended when it is asked: its figures are kept (STATS_KEEP_S).
 */
START_TEST(a_job_of_128_ranks_shows_the_tokens_each_rank_sends_to_rank_100) {
  /* world hidden topk experts max_tokens max_ll routing tokens index fp8 */
  const struct ow_scenario sc = {SW_WORLD, 128, 4, 256, 4, 2, P_RANDOM, T_MAX, DEP_INDEX_I32, 0};
  ow_seed_init(sc.world);
  struct ow_case *c = xn_case_new(&sc, 0);
  struct nodes ns;
  xn_nodes_start(&ns, 2, SW_ATTACH_TIMEOUT_MS, SW_OP_TIMEOUT_MS, "");
  const uint32_t split[] = {DEP_MAX_LOCAL_RANKS, DEP_MAX_LOCAL_RANKS};
  struct xn_place p;
  xn_place(&p, split, 2);
  struct xn_run run = {.d = c, .rounds = 1};
  struct xn_result *res = xn_results(sc.world);
  xn_run_job(&ns, &p, "st128", &run, res);
  munmap(res, sc.world * sizeof *res);
  uint32_t to100 = 0;
  for (uint32_t g = 0; g < SW_WORLD; g++)
    to100 += sw_tokens(c, g, 100);
  ck_assert_msg(to100 > 0, "the case sends rank 100 nothing: the test would show nothing");
  static char json[1 << 20], text[1 << 16];
  for (int i = 0; i < 2; i++) {
    xn_ctl_json_at(&ns, i, "stats st128", json, sizeof json);
    sw_ctl_text(&ns, i, "stats st128", text, sizeof text);
    const uint32_t first = (uint32_t)i * DEP_MAX_LOCAL_RANKS;
    for (uint32_t g = first; g < first + DEP_MAX_LOCAL_RANKS; g++)
      sw_expect_tokens_to(json, c, g);
    sw_expect_balance(json, text, c, first);
    ck_assert_msg(strstr(json, "\"tokens_left_out\":0,") != NULL, "%.300s", json);
  }
  /* With limits.client_queue_bytes at 64 KiB, a reply's counts take 16 KiB at most: the first
   * 32 of node 0's ranks (512 bytes each) have theirs, the other 32 go without, and the
   * balance is of the 32 (the reload is live, the job's figures kept). */
  char conf[sizeof ns.yaml[0] + 64], *lim = strstr(ns.yaml[0], "limits: {");
  ck_assert_ptr_nonnull(lim);
  dw_sfmt(conf, sizeof conf, "%.*slimits: {client_queue_bytes: 64KiB, %s",
          (int)(lim - ns.yaml[0]), ns.yaml[0], lim + strlen("limits: {"));
  ck_assert_int_eq(tu_write_file(ns.d[0].conf, conf), 0);
  sw_ctl_text(&ns, 0, "reload", text, sizeof text);
  xn_ctl_json_at(&ns, 0, "stats st128", json, sizeof json);
  sw_ctl_text(&ns, 0, "stats st128", text, sizeof text);
  ck_assert_msg(strstr(json, "\"tokens_left_out\":32,") != NULL, "%.300s", json);
  uint32_t nulls = 0;
  for (const char *q = json; (q = strstr(q, "\"tokens_to\":null")) != NULL; q++)
    nulls++;
  ck_assert_uint_eq(nulls, 32);
  for (uint32_t g = 0; g < 32; g++)
    sw_expect_tokens_to(json, c, g);
  ck_assert_msg(strstr(json, "\"balance\":[{\"job\":\"st128\",\"ranks\":32,\"world\":128,") !=
                    NULL,
                "%.600s", strstr(json, "\"balance\""));
  const char *said = strstr(text, "ranks' tokens left out:");
  ck_assert_msg(said != NULL, "%.600s", text);
  said += strspn(said + strlen("ranks' tokens left out:"), " ") + strlen("ranks' tokens left out:");
  ck_assert_msg(strncmp(said, "32\n", 3) == 0, "%.600s", text);
  nodes_stop(&ns);
  xn_case_free(c);
}
END_TEST

/* ---- cuda: the kernels' own times against CUDA events ---------------------------------- */

Suite *stats_world_suite(void);
Suite *stats_world_suite(void) {
  Suite *s = suite_create("stats_world");
  TCase *t = tcase_create("big world");
  tcase_set_timeout(t, 300); /* 128 processes attaching on 2 loaded cores (check_bigworld.c) */
  tcase_add_test(t, a_job_of_128_ranks_shows_the_tokens_each_rank_sends_to_rank_100);
  suite_add_tcase(s, t);
  return s;
}
