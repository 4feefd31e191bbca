/*
 * check_handles.c — handles whose arrays live in memory the caller lends
 * (dep_handle_bytes, dep_handle_new_in), on the host backend: rank
 * processes attached to a real deepepd run a dispatch/combine pair and a
 * low-latency pair through such a handle, every output against the oracle
 * (tests/ref.c) as check_ops holds the host operations to it; the lent
 * memory's neighbours are poisoned and must stay so, and the library must
 * not free it (the rank frees it itself after dep_handle_free, so a second
 * free aborts the rank).  The refusals (not attached, NULL, misaligned,
 * too short, a handle too small for a job attached later) each say what
 * is wrong and what to do.  dep_handle_recv_from's counts per source, and
 * dep_ll_handle_info's source token of each low-latency row and rows per
 * source, are held to the oracle's too, and the latter's refusals (a
 * throughput, empty or earlier attachment's handle, NULL or misaligned
 * outputs) checked.  The same on cuda, through cuMemAlloc'd memory,
 * is check_cuda_ops's (gpu).
 *
 * Inputs are fresh random data each run; a failure prints the seed, and
 * DEP_TEST_SEED=<seed> replays it.
 */
#include <check.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "clienttest.h"
#include "daemonwire.h"
#include "deepep.h"
#include "opsworld.h"
#include "ref.h"
#include "testutil.h"

#define HD_POISON 0xa5
/* Poisoned bytes on each side of a handle's lent memory. */
#define HD_GUARD 4096u

static const struct ow_scenario hd_scenarios[] = {
  /* world hidden topk experts max_tokens max_ll  routing  tokens  index  fp8 */
  {1, 128, 2, 4, 8, 8, P_RANDOM, T_MAX, DEP_INDEX_I64, 0},
  {2, 256, 4, 8, 16, 16, P_DUP, T_MIXED, DEP_INDEX_I32, 0},
  {4, 128, 2, 16, 24, 8, P_RANDOM, T_MIXED, DEP_INDEX_I64, 0},
};

/* A call that must succeed; otherwise the rank fails with the library's message. */
#define HD_CALL(expr, op)                                                                  \
  do {                                                                                     \
    int rc_ = (expr);                                                                      \
    if (rc_ != 0)                                                                          \
      return ow_fail(msg, "rank %u: %s returned %s: %s [%s]", r, op, dep_errname(rc_),     \
                     dep_errmsg(c), d->desc);                                              \
  } while (0)

/* A call that must be refused with code, its message holding want. */
static int hd_refused(dep_client_t *c, int rc, int code, const char *want, const char *what,
                      char *msg) {
  if (rc != code || strstr(dep_errmsg(c), want) == NULL)
    return ow_fail(msg, "%s: %s (\"%s\"), want %s saying \"%s\"", what, dep_errname(rc),
                   dep_errmsg(c), dep_errname(code), want);
  return 0;
}

/* Throughput dispatch and combine of rank r of case d through h, against the oracle. */
static int hd_round_tp(dep_client_t *c, dep_handle_t *h, const struct ow_case *d, uint32_t r,
                       struct ow_outs *o, char *msg) {
  const uint32_t hid = d->sc.hidden, K = d->sc.topk;
  const struct ref_rank_in *in = &d->in[r];
  const struct ref_dispatch_out *e = &d->disp[r];
  memset(o->rx, HD_POISON, o->rows_tp * hid * 2);
  memset(o->ridx, HD_POISON, o->rows_tp * K * 4);
  memset(o->rw, HD_POISON, o->rows_tp * K * 4);
  memset(o->cnt, HD_POISON, d->le * 4);
  o->num_recv = 0;
  struct dep_dispatch_args da = {.size = sizeof da, .x = in->x, .topk_idx = d->idx[r],
                                 .index_type = d->sc.itype, .topk_weights = in->topk_weights,
                                 .num_tokens = in->num_tokens, .recv_x = o->rx,
                                 .recv_topk_idx = o->ridx, .recv_topk_weights = o->rw,
                                 .recv_count_per_expert = o->cnt, .num_recv = &o->num_recv};
  HD_CALL(dep_dispatch(c, &da, h, NULL), "dep_dispatch");
  if (o->num_recv != e->num_recv)
    return ow_fail(msg, "rank %u: dispatch: num_recv %u, want %u [%s]", r, o->num_recv,
                   e->num_recv, d->desc);
  for (uint32_t i = 0; i < e->num_recv; i++) {
    if (memcmp(o->rx + (size_t)i * hid, e->x + (size_t)i * hid, hid * 2) != 0)
      return ow_fail(msg, "rank %u: dispatch: recv_x row %u is not token %u of rank %u [%s]", r,
                     i, e->from[i].token, e->from[i].rank, d->desc);
    for (uint32_t k = 0; k < K; k++) {
      size_t j = (size_t)i * K + k;
      if (o->ridx[j] != e->topk_idx[j] || memcmp(&o->rw[j], &e->topk_weights[j], 4) != 0)
        return ow_fail(msg, "rank %u: dispatch: row %u k %u: id %d weight %g, want %d %g [%s]",
                       r, i, k, o->ridx[j], o->rw[j], e->topk_idx[j], e->topk_weights[j],
                       d->desc);
    }
  }
  for (uint32_t l = 0; l < d->le; l++)
    if (o->cnt[l] != e->count[l])
      return ow_fail(msg, "rank %u: dispatch: recv_count_per_expert[%u] %d, want %d [%s]", r, l,
                     o->cnt[l], e->count[l], d->desc);
  /* The rows from each source, as the oracle's rows say where they came from. */
  uint32_t from[OW_MAXW], want[OW_MAXW] = {0};
  for (uint32_t i = 0; i < e->num_recv; i++)
    want[e->from[i].rank]++;
  HD_CALL(dep_handle_recv_from(c, h, from, d->sc.world), "dep_handle_recv_from");
  for (uint32_t s = 0; s < d->sc.world; s++)
    if (from[s] != want[s])
      return ow_fail(msg, "rank %u: dep_handle_recv_from[%u] %u, want %u [%s]", r, s, from[s],
                     want[s], d->desc);
  memset(o->out, HD_POISON, (size_t)d->sc.max_tokens * hid * 2);
  struct dep_combine_args ca = {.size = sizeof ca, .x = d->cx[r], .out = o->out};
  HD_CALL(dep_combine(c, &ca, h, NULL), "dep_combine");
  if (ow_check_sum(o->out, &d->comb[r], in->num_tokens, hid, "combine", d->desc, msg))
    return 1;
  if (ow_unpoisoned(o->out + (size_t)in->num_tokens * hid,
                    (size_t)(d->sc.max_tokens - in->num_tokens) * hid * 2, HD_POISON) >= 0)
    return ow_fail(msg, "rank %u: combine: wrote past num_tokens %u [%s]", r, in->num_tokens,
                   d->desc);
  return 0;
}

/* Low-latency dispatch (bf16) and combine of rank r of case d through h, against the oracle. */
static int hd_round_ll(dep_client_t *c, dep_handle_t *h, const struct ow_case *d, uint32_t r,
                       struct ow_outs *o, char *msg) {
  const uint32_t hid = d->sc.hidden, rows = d->rows_ll;
  const struct ref_rank_in *in = &d->in_ll[r];
  const struct ref_ll_out *e = &d->ll[r];
  memset(o->lx, HD_POISON, o->n_lx * 2);
  memset(o->lcnt, HD_POISON, d->le * 4);
  memset(o->lsrc, HD_POISON, (size_t)d->le * rows * 4);
  memset(o->lrange, HD_POISON, (size_t)d->le * d->sc.world * 8);
  struct dep_ll_handle_info_args ia = {.size = sizeof ia, .src_info = o->lsrc,
                                       .layout_range = o->lrange};
  /* h holds the throughput dispatch of hd_round_tp. */
  if (hd_refused(c, dep_ll_handle_info(c, &ia, h, NULL), DEP_ERR_INVALID,
                 "the handle holds a throughput dispatch (dep_dispatch); pass the handle of a "
                 "low-latency dispatch", "dep_ll_handle_info of a throughput handle", msg))
    return 1;
  struct dep_ll_dispatch_args la = {.size = sizeof la, .x = in->x, .topk_idx = d->idx[r],
                                    .index_type = d->sc.itype, .num_tokens = in->num_tokens,
                                    .recv_x = o->lx, .recv_count = o->lcnt};
  HD_CALL(dep_ll_dispatch(c, &la, h, NULL), "dep_ll_dispatch");
  struct dep_ll_handle_info_args bad_src = ia, bad_range = ia;
  bad_src.src_info = NULL;
  bad_range.layout_range = (int64_t *)((uint8_t *)o->lrange + 4);
  if (hd_refused(c, dep_ll_handle_info(c, &ia, NULL, NULL), DEP_ERR_INVALID, "h is NULL",
                 "dep_ll_handle_info(h NULL)", msg) ||
      hd_refused(c, dep_ll_handle_info(c, &bad_src, h, NULL), DEP_ERR_INVALID,
                 "src_info is NULL", "dep_ll_handle_info(src_info NULL)", msg) ||
      hd_refused(c, dep_ll_handle_info(c, &bad_range, h, NULL), DEP_ERR_INVALID,
                 "layout_range is not 8-byte aligned", "dep_ll_handle_info(misaligned)", msg))
    return 1;
  if (ow_unpoisoned(o->lsrc, (size_t)d->le * rows * 4, HD_POISON) >= 0 ||
      ow_unpoisoned(o->lrange, (size_t)d->le * d->sc.world * 8, HD_POISON) >= 0)
    return ow_fail(msg, "rank %u: a refused dep_ll_handle_info wrote its outputs [%s]", r,
                   d->desc);
  HD_CALL(dep_ll_handle_info(c, &ia, h, NULL), "dep_ll_handle_info");
  if (ow_check_ll_info(d, r, o->lsrc, o->lrange, msg))
    return 1;
  for (uint32_t l = 0; l < d->le; l++) {
    if (o->lcnt[l] != e->count[l])
      return ow_fail(msg, "rank %u: ll_dispatch: recv_count[%u] %d, want %d [%s]", r, l,
                     o->lcnt[l], e->count[l], d->desc);
    for (uint32_t i = 0; i < rows; i++) {
      const size_t row = (size_t)l * rows + i;
      const uint8_t *got = o->lx + row * hid * 2;
      if ((int32_t)i >= e->count[l] ? ow_unpoisoned(got, hid * 2, HD_POISON) >= 0
                                    : memcmp(got, e->x + row * hid, hid * 2) != 0)
        return ow_fail(msg, "rank %u: ll_dispatch: expert %u row %u (count %d) differs from the "
                       "oracle [%s]", r, l, i, e->count[l], d->desc);
    }
  }
  memset(o->lout, HD_POISON, (size_t)d->max_ll * hid * 2);
  struct dep_ll_combine_args lc = {.size = sizeof lc, .x = d->lx[r], .topk_idx = d->idx[r],
                                   .index_type = d->sc.itype, .topk_weights = in->topk_weights,
                                   .out = o->lout};
  HD_CALL(dep_ll_combine(c, &lc, h, NULL), "dep_ll_combine");
  if (ow_check_sum(o->lout, &d->llc[r], in->num_tokens, hid, "ll_combine", d->desc, msg))
    return 1;
  if (ow_unpoisoned(o->lout + (size_t)in->num_tokens * hid,
                    (size_t)(d->max_ll - in->num_tokens) * hid * 2, HD_POISON) >= 0)
    return ow_fail(msg, "rank %u: ll_combine: wrote past num_tokens %u [%s]", r, in->num_tokens,
                   d->desc);
  return 0;
}

/* Memory for a handle of n bytes with HD_GUARD poisoned bytes on each side; the handle's
 * bytes are poisoned too (the library must need no initialising). */
static uint8_t *hd_lend(size_t n) {
  uint8_t *m = aligned_alloc(DEP_HANDLE_ALIGN, 2 * HD_GUARD + dep_round_up(n, DEP_HANDLE_ALIGN));
  if (m != NULL)
    memset(m, HD_POISON, 2 * HD_GUARD + n);
  return m;
}

/* Neither guard of hd_lend's memory written. */
static int hd_guards_kept(const uint8_t *m, size_t n, const char *when, uint32_t r, char *msg) {
  long lo = ow_unpoisoned(m, HD_GUARD, HD_POISON);
  long hi = ow_unpoisoned(m + HD_GUARD + n, HD_GUARD, HD_POISON);
  if (lo >= 0 || hi >= 0)
    return ow_fail(msg, "rank %u: %s: the library wrote outside the handle's %zu bytes (%s "
                   "guard, byte %ld)", r, when, n, lo >= 0 ? "lower" : "upper", lo >= 0 ? lo : hi);
  return 0;
}

/*
 * What each rank of a case does once attached: the refusals of bad memory
 * (no communication), then two rounds of the throughput and the
 * low-latency pair through one handle in lent memory, its guards checked
 * after each, then dep_handle_free and its own free of the memory.
 */
static int hd_rank(dep_client_t *c, const struct ow_case *d, uint32_t r, char *msg) {
  size_t n = 0;
  dep_handle_t *h = NULL;
  HD_CALL(dep_handle_bytes(c, &n), "dep_handle_bytes");
  if (n == 0 || n % DEP_HANDLE_ALIGN != 0)
    return ow_fail(msg, "rank %u: dep_handle_bytes %zu, want a positive multiple of %d [%s]", r,
                   n, DEP_HANDLE_ALIGN, d->desc);
  uint8_t *m = hd_lend(n);
  if (m == NULL)
    return ow_fail(msg, "rank %u: out of memory", r);
  uint8_t *mem = m + HD_GUARD;
  char what[64];
  struct {
    void *mem;
    size_t bytes;
    dep_handle_t **out;
    const char *want;
  } bad[] = {
    {NULL, n, &h, "mem is NULL"},
    {mem + 8, n, &h, "is not 256-byte aligned (DEP_HANDLE_ALIGN)"},
    {mem + DEP_HANDLE_ALIGN / 2, n, &h, "aligned_alloc"},
    {mem, n - 1, &h, "dep_handle_bytes"},
    {mem, 0, &h, "is less than a handle of this job takes"},
    {mem, n, NULL, "out is NULL"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    snprintf(what, sizeof what, "rank %u: refusal %zu", r, i);
    if (hd_refused(c, dep_handle_new_in(c, bad[i].mem, bad[i].bytes, bad[i].out),
                   DEP_ERR_INVALID, bad[i].want, what, msg))
      return 1;
    if (h != NULL)
      return ow_fail(msg, "%s: *out is %p, want NULL", what, (void *)h);
  }
  if (hd_refused(c, dep_handle_bytes(c, NULL), DEP_ERR_INVALID, "bytes is NULL",
                 "dep_handle_bytes(NULL)", msg))
    return 1;
  if (hd_guards_kept(m, n, "the refusals", r, msg) ||
      ow_unpoisoned(mem, n, HD_POISON) >= 0)
    return ow_fail(msg, "rank %u: a refused dep_handle_new_in wrote into the memory", r);
  HD_CALL(dep_handle_new_in(c, mem, n, &h), "dep_handle_new_in");
  struct ow_outs o;
  ow_outs_alloc(&o, d);
  int rc = 0;
  for (int round = 0; round < 2 && rc == 0; round++)
    rc = hd_round_tp(c, h, d, r, &o, msg) || hd_guards_kept(m, n, "dispatch, combine", r, msg) ||
         hd_round_ll(c, h, d, r, &o, msg) || hd_guards_kept(m, n, "the LL pair", r, msg);
  ow_outs_free(&o);
  if (rc == 0 && d->in[r].num_tokens > 0 && ow_unpoisoned(mem, n, HD_POISON) < 0)
    rc = ow_fail(msg, "rank %u: dispatched %u tokens, but nothing was written into the lent "
                 "memory: the handle's arrays are elsewhere [%s]", r, d->in[r].num_tokens,
                 d->desc);
  dep_handle_free(h);
  if (rc == 0)
    rc = hd_guards_kept(m, n, "dep_handle_free", r, msg);
  free(m); /* ours: a library that freed it too aborts here */
  return rc;
}

/* A world of d->sc.world rank processes on daemon dm, each attached to job, running hd_rank;
 * the test fails with every failing rank's message and the seed. */
static void hd_run(const struct tu_daemon *dm, const char *job, const struct ow_case *d) {
  const uint32_t W = d->sc.world;
  struct dw_child ch[OW_MAXW];
  for (uint32_t r = 0; r < W; r++) {
    dw_child_fork(&ch[r]);
    if (ch[r].pid != 0)
      continue;
    char msg[OW_MSG] = "ok";
    dep_client_t *c = NULL;
    struct dep_attach_args a = {.size = sizeof a, .rank = r, .world_size = W, .local_rank = r,
                                .local_world_size = W, .shape = d->shape};
    snprintf(a.job_id, sizeof a.job_id, "%s", job);
    int rc = dep_client_new(&c);
    if (rc == 0 && ((rc = dep_connect(c, dm->sock)) != 0 || (rc = dep_attach(c, &a)) != 0))
      snprintf(msg, sizeof msg, "rank %u: connect/attach: %s", r, dep_errmsg(c));
    if (rc == 0 && hd_rank(c, d, r, msg) != 0)
      rc = 1;
    if (write(ch[r].rep, msg, strlen(msg) + 1) < 0)
      _exit(3);
    dep_client_free(c);
    _exit(rc == 0 ? 0 : 1);
  }
  char fails[OW_FAILS_LEN] = "";
  int nfailed = 0;
  for (uint32_t r = 0; r < W; r++) {
    char msg[OW_MSG] = "";
    ssize_t got = read(ch[r].rep, msg, sizeof msg - 1);
    int st = 0;
    ck_assert_int_eq(waitpid(ch[r].pid, &st, 0), ch[r].pid);
    close(ch[r].rep);
    close(ch[r].go);
    if (got > 0 && strcmp(msg, "ok") == 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0)
      continue;
    nfailed++;
    size_t at = strlen(fails);
    snprintf(fails + at, sizeof fails - at, "\n  rank %u (status 0x%x): %s", r, st,
             got > 0 ? msg : "exited before reporting");
  }
  OW_ASSERT_NONE_FAILED(d->desc, nfailed, fails);
}

START_TEST(pairs_through_a_handle_in_lent_memory_match_the_oracle) {
  ow_seed_init((uint64_t)_i);
  struct ow_case *d = malloc(sizeof *d);
  ck_assert_ptr_nonnull(d);
  ow_case_make(d, &hd_scenarios[_i], 0);
  struct tu_daemon dm;
  dw_start(&dm, NULL);
  char job[32];
  dw_sfmt(job, sizeof job, "handles-%d", _i);
  hd_run(&dm, job, d);
  dw_stop_ok(&dm);
  ow_case_free(d);
  free(d);
}
END_TEST

/* One rank of a job of this shape on daemon dm, attached as job. */
static dep_client_t *hd_attach_one(const struct tu_daemon *dm, const char *job,
                                   const struct dep_job_shape *s) {
  struct dep_attach_args a = {.size = sizeof a, .world_size = 1, .local_world_size = 1,
                              .shape = *s};
  snprintf(a.job_id, sizeof a.job_id, "%s", job);
  dep_client_t *c = cl_connect(dm->sock);
  ck_assert_msg(dep_attach(c, &a) == 0, "dep_attach: %s", dep_errmsg(c));
  return c;
}

START_TEST(a_client_not_attached_is_refused_and_told_to_attach) {
  dep_client_t *c = NULL;
  ck_assert_int_eq(dep_client_new(&c), 0);
  size_t n = 7;
  dep_handle_t *h = NULL;
  static uint8_t mem[4096] __attribute__((aligned(DEP_HANDLE_ALIGN)));
  ck_assert_int_eq(dep_handle_bytes(c, &n), DEP_ERR_STATE);
  ck_assert_msg(strstr(dep_errmsg(c), "call dep_attach first") != NULL, "%s", dep_errmsg(c));
  ck_assert_uint_eq(n, 7);
  ck_assert_int_eq(dep_handle_new_in(c, mem, sizeof mem, &h), DEP_ERR_STATE);
  ck_assert_msg(strstr(dep_errmsg(c), "dep_handle_new_in: not attached") != NULL, "%s",
                dep_errmsg(c));
  ck_assert_ptr_null(h);
  ck_assert_int_eq(dep_handle_bytes(NULL, &n), DEP_ERR_INVALID);
  ck_assert_int_eq(dep_handle_new_in(NULL, mem, sizeof mem, &h), DEP_ERR_INVALID);
  uint32_t from[1];
  ck_assert_int_eq(dep_handle_new(c, &h), 0);
  ck_assert_int_eq(dep_handle_recv_from(c, h, from, 1), DEP_ERR_STATE);
  ck_assert_msg(strstr(dep_errmsg(c), "call dep_attach first") != NULL, "%s", dep_errmsg(c));
  ck_assert_int_eq(dep_handle_recv_from(NULL, h, from, 1), DEP_ERR_INVALID);
  int32_t src[1];
  int64_t range[1];
  struct dep_ll_handle_info_args ia = {.size = sizeof ia, .src_info = src, .layout_range = range};
  ck_assert_int_eq(dep_ll_handle_info(c, &ia, h, NULL), DEP_ERR_STATE);
  ck_assert_msg(strstr(dep_errmsg(c), "call dep_attach first") != NULL, "%s", dep_errmsg(c));
  ck_assert_int_eq(dep_ll_handle_info(NULL, &ia, h, NULL), DEP_ERR_INVALID);
  dep_handle_free(h);
  dep_client_free(c);
}
END_TEST

/*
 * dep_ll_handle_info reads a handle of this attachment's low-latency
 * dispatch only: an empty handle, and one an earlier attachment filled,
 * are refused naming what they hold, before anything is written.
 */
START_TEST(ll_handle_info_reads_only_this_attachments_low_latency_dispatch) {
  struct tu_daemon dm;
  dw_start(&dm, NULL);
  const struct dep_job_shape sh = {.max_tokens_per_rank = 8, .hidden = 128, .num_experts = 4,
                                   .topk = 2, .dtype = DEP_DTYPE_BF16,
                                   .max_ll_tokens_per_rank = 8};
  dep_client_t *c = hd_attach_one(&dm, "hd-info-1", &sh);
  dep_handle_t *h = NULL;
  ck_assert_int_eq(dep_handle_new(c, &h), 0);
  /* One rank, four local experts of 8 rows: token t names experts t % 4 and 3. */
  static uint16_t x[8 * 128], rx[4 * 8 * 128];
  static int64_t idx[8 * 2];
  static int32_t cnt[4], src[4 * 8];
  static int64_t range[4];
  for (int t = 0; t < 8; t++)
    idx[2 * t] = t % 4, idx[2 * t + 1] = t % 4 == 3 ? -1 : 3;
  struct dep_ll_handle_info_args ia = {.size = sizeof ia, .src_info = src, .layout_range = range};
  memset(src, HD_POISON, sizeof src);
  ck_assert_int_eq(dep_ll_handle_info(c, &ia, h, NULL), DEP_ERR_INVALID);
  ck_assert_msg(strstr(dep_errmsg(c), "the handle holds no dispatch") != NULL, "%s",
                dep_errmsg(c));
  struct dep_ll_dispatch_args la = {.size = sizeof la, .x = x, .topk_idx = idx,
                                    .index_type = DEP_INDEX_I64, .num_tokens = 8, .recv_x = rx,
                                    .recv_count = cnt};
  ck_assert_msg(dep_ll_dispatch(c, &la, h, NULL) == 0, "dep_ll_dispatch: %s", dep_errmsg(c));
  ck_assert_msg(dep_ll_handle_info(c, &ia, h, NULL) == 0, "%s", dep_errmsg(c));
  /* Expert 3: tokens 0..7 (each names it once); experts 0..2: tokens l and l + 4. */
  for (int l = 0; l < 4; l++) {
    const int n = l == 3 ? 8 : 2;
    ck_assert_int_eq(cnt[l], n);
    ck_assert_int_eq(DEP_LL_RANGE_BEGIN(range[l]), 0);
    ck_assert_int_eq(DEP_LL_RANGE_COUNT(range[l]), n);
    for (int i = 0; i < 8; i++)
      ck_assert_int_eq(src[l * 8 + i], i >= n ? -1 : l == 3 ? i : l + 4 * i);
  }
  ck_assert_int_eq(dep_detach(c), 0);
  struct dep_attach_args a = {.size = sizeof a, .world_size = 1, .local_world_size = 1,
                              .shape = sh};
  snprintf(a.job_id, sizeof a.job_id, "hd-info-2");
  ck_assert_msg(dep_attach(c, &a) == 0, "dep_attach: %s", dep_errmsg(c));
  memset(src, HD_POISON, sizeof src);
  ck_assert_int_eq(dep_ll_handle_info(c, &ia, h, NULL), DEP_ERR_INVALID);
  ck_assert_msg(strstr(dep_errmsg(c), "earlier attachment") != NULL, "%s", dep_errmsg(c));
  ck_assert_int_lt(ow_unpoisoned(src, sizeof src, HD_POISON), 0);
  dep_handle_free(h);
  ck_assert_int_eq(dep_detach(c), 0);
  dep_client_free(c);
  dw_stop_ok(&dm);
}
END_TEST

/*
 * A low-latency send not yet received holds its handle (deepep.h "Split
 * calls"), through the public entry points: the call is counted at its
 * send (dep_next_call); a throughput dispatch into the handle, a read of it
 * and a combine of it are refused until the receive has run; then the
 * receive writes the dispatch's rows and a split combine returns each
 * token's rows weighted, as a whole one does.
 */
START_TEST(a_handle_held_by_a_send_is_refused_to_other_calls_until_its_receive) {
  struct tu_daemon dm;
  dw_start(&dm, NULL);
  const struct dep_job_shape sh = {.max_tokens_per_rank = 8, .hidden = 128, .num_experts = 4,
                                   .topk = 2, .dtype = DEP_DTYPE_BF16,
                                   .max_ll_tokens_per_rank = 8};
  dep_client_t *c = hd_attach_one(&dm, "hd-split", &sh);
  dep_handle_t *h = NULL;
  ck_assert_int_eq(dep_handle_new(c, &h), 0);
  /* Token t (value t + 1 in every channel) names experts t % 4 and 3 (not twice). */
  static uint16_t x[8 * 128], rx[4 * 8 * 128], out[8 * 128], want[8 * 128];
  static int64_t idx[8 * 2];
  static int32_t cnt[4], src[4 * 8];
  static int64_t range[4];
  static float w[8 * 2];
  for (int t = 0; t < 8; t++) {
    idx[2 * t] = t % 4, idx[2 * t + 1] = t % 4 == 3 ? -1 : 3;
    w[2 * t] = w[2 * t + 1] = 1.0f;
    for (int i = 0; i < 128; i++) {
      const float f = (float)(t + 1), g = (float)(t % 4 == 3 ? t + 1 : 2 * (t + 1));
      uint32_t u, v;
      memcpy(&u, &f, 4), memcpy(&v, &g, 4);
      x[t * 128 + i] = (uint16_t)(u >> 16), want[t * 128 + i] = (uint16_t)(v >> 16);
    }
  }
  struct dep_ll_dispatch_args la = {.size = sizeof la, .x = x, .topk_idx = idx,
                                    .index_type = DEP_INDEX_I64, .num_tokens = 8, .recv_x = rx,
                                    .recv_count = cnt, .phases = DEP_LL_SEND};
  ck_assert_msg(dep_ll_dispatch(c, &la, h, NULL) == 0, "send: %s", dep_errmsg(c));
  uint64_t call = 0;
  ck_assert_int_eq(dep_next_call(c, &call), 0);
  ck_assert_uint_eq(call, 2);
  memset(x, 0xFF, sizeof x); /* the send has read it */
  uint32_t nr = 0;
  static uint16_t trx[64 * 128];
  static int32_t tidx[64 * 2], tcnt[4];
  static float tw[64 * 2];
  struct dep_dispatch_args da = {.size = sizeof da, .x = x, .topk_idx = idx,
                                 .index_type = DEP_INDEX_I64, .topk_weights = w, .num_tokens = 8,
                                 .recv_x = trx, .recv_topk_idx = tidx, .recv_topk_weights = tw,
                                 .recv_count_per_expert = tcnt, .num_recv = &nr};
  ck_assert_int_eq(dep_dispatch(c, &da, h, NULL), DEP_ERR_INVALID);
  ck_assert_msg(strstr(dep_errmsg(c), "dep_dispatch: the handle holds the send of low-latency "
                       "call 1, whose receive (DEP_LL_RECV) has not run") != NULL, "%s",
                dep_errmsg(c));
  struct dep_ll_handle_info_args ia = {.size = sizeof ia, .src_info = src, .layout_range = range};
  ck_assert_int_eq(dep_ll_handle_info(c, &ia, h, NULL), DEP_ERR_INVALID);
  struct dep_ll_combine_args lc = {.size = sizeof lc, .x = rx, .topk_idx = idx,
                                   .index_type = DEP_INDEX_I64, .topk_weights = w, .out = out};
  ck_assert_int_eq(dep_ll_combine(c, &lc, h, NULL), DEP_ERR_INVALID);
  ck_assert_msg(strstr(dep_errmsg(c), "phases: the handle holds the send of call 1") != NULL,
                "%s", dep_errmsg(c));
  ck_assert_int_eq(dep_next_call(c, &call), 0);
  ck_assert_uint_eq(call, 2);
  la.phases = DEP_LL_RECV;
  ck_assert_msg(dep_ll_dispatch(c, &la, h, NULL) == 0, "receive: %s", dep_errmsg(c));
  for (int l = 0; l < 4; l++)
    ck_assert_int_eq(cnt[l], l == 3 ? 8 : 2);
  ck_assert_msg(dep_ll_handle_info(c, &ia, h, NULL) == 0, "%s", dep_errmsg(c));
  lc.phases = DEP_LL_SEND;
  ck_assert_msg(dep_ll_combine(c, &lc, h, NULL) == 0, "combine send: %s", dep_errmsg(c));
  lc.phases = DEP_LL_RECV;
  ck_assert_msg(dep_ll_combine(c, &lc, h, NULL) == 0, "combine receive: %s", dep_errmsg(c));
  ck_assert_msg(memcmp(out, want, sizeof out) == 0, "the split combine's out is not each "
                "token's rows summed");
  ck_assert_int_eq(dep_next_call(c, &call), 0);
  ck_assert_uint_eq(call, 3);
  dep_handle_free(h);
  ck_assert_int_eq(dep_detach(c), 0);
  dep_client_free(c);
  dw_stop_ok(&dm);
}
END_TEST

/*
 * A handle's size is its job's: after a dep_attach to a job whose handles
 * take more, a dispatch into the old memory is refused before anything
 * runs (and the memory stays untouched), and one sized anew works.
 */
START_TEST(a_handle_too_small_for_a_later_job_is_refused_at_its_dispatch) {
  struct tu_daemon dm;
  dw_start(&dm, NULL);
  const struct dep_job_shape small = {.max_tokens_per_rank = 8, .hidden = 128,
                                      .num_experts = 4, .topk = 2, .dtype = DEP_DTYPE_BF16};
  struct dep_job_shape big = small;
  big.max_tokens_per_rank = 64;
  dep_client_t *c = hd_attach_one(&dm, "hd-small", &small);
  size_t n_small = 0, n_big = 0;
  ck_assert_int_eq(dep_handle_bytes(c, &n_small), 0);
  uint8_t *m = hd_lend(n_small);
  ck_assert_ptr_nonnull(m);
  dep_handle_t *h = NULL;
  ck_assert_int_eq(dep_handle_new_in(c, m + HD_GUARD, n_small, &h), 0);
  ck_assert_int_eq(dep_detach(c), 0);
  struct dep_attach_args a = {.size = sizeof a, .world_size = 1, .local_world_size = 1,
                              .shape = big};
  snprintf(a.job_id, sizeof a.job_id, "hd-big");
  ck_assert_msg(dep_attach(c, &a) == 0, "dep_attach: %s", dep_errmsg(c));
  ck_assert_int_eq(dep_handle_bytes(c, &n_big), 0);
  ck_assert_uint_gt(n_big, n_small);

  static uint16_t x[64 * 128], rx[64 * 128];
  static int64_t idx[64 * 2];
  static float w[64 * 2], rw[64 * 2];
  static int32_t ridx[64 * 2], cnt[4];
  for (int t = 0; t < 64; t++)
    idx[2 * t] = t % 4, idx[2 * t + 1] = -1, w[2 * t] = 1.0f;
  uint32_t nr = 0;
  struct dep_dispatch_args da = {.size = sizeof da, .x = x, .topk_idx = idx,
                                 .index_type = DEP_INDEX_I64, .topk_weights = w,
                                 .num_tokens = 64, .recv_x = rx, .recv_topk_idx = ridx,
                                 .recv_topk_weights = rw, .recv_count_per_expert = cnt,
                                 .num_recv = &nr};
  ck_assert_int_eq(dep_dispatch(c, &da, h, NULL), DEP_ERR_INVALID);
  ck_assert_msg(strstr(dep_errmsg(c), "it was made for another job; make a new handle") != NULL,
                "%s", dep_errmsg(c));
  ck_assert_int_lt(ow_unpoisoned(m, 2 * HD_GUARD + n_small, HD_POISON), 0);
  dep_handle_free(h);
  free(m);

  m = hd_lend(n_big);
  ck_assert_ptr_nonnull(m);
  ck_assert_int_eq(dep_handle_new_in(c, m + HD_GUARD, n_big, &h), 0);
  ck_assert_msg(dep_dispatch(c, &da, h, NULL) == 0, "dep_dispatch: %s", dep_errmsg(c));
  ck_assert_uint_eq(nr, 64);
  struct dep_combine_args ca = {.size = sizeof ca, .x = rx, .out = x};
  ck_assert_msg(dep_combine(c, &ca, h, NULL) == 0, "dep_combine: %s", dep_errmsg(c));
  char msg[OW_MSG] = "";
  ck_assert_msg(hd_guards_kept(m, n_big, "a dispatch of the new job", 0, msg) == 0, "%s", msg);
  dep_handle_free(h);
  free(m);
  ck_assert_int_eq(dep_detach(c), 0);
  dep_client_free(c);
  dw_stop_ok(&dm);
}
END_TEST

Suite *handles_suite(void);
Suite *handles_suite(void) {
  Suite *s = suite_create("handles");
  TCase *lent = tcase_create("lent");
  tcase_set_timeout(lent, 60);
  tcase_add_loop_test(lent, pairs_through_a_handle_in_lent_memory_match_the_oracle, 0,
                      (int)(sizeof hd_scenarios / sizeof hd_scenarios[0]));
  tcase_add_test(lent, a_client_not_attached_is_refused_and_told_to_attach);
  tcase_add_test(lent, a_handle_too_small_for_a_later_job_is_refused_at_its_dispatch);
  tcase_add_test(lent, ll_handle_info_reads_only_this_attachments_low_latency_dispatch);
  tcase_add_test(lent, a_handle_held_by_a_send_is_refused_to_other_calls_until_its_receive);
  suite_add_tcase(s, lent);
  return s;
}
